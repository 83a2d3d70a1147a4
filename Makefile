# Thin wrapper around CMake + CTest.  `make` builds build/meshlm,
# `make test` runs the whole suite, `make demo` runs the main job.
BUILD ?= build
JOBS ?= $(shell nproc)

.PHONY: all deps build test demo install clean

all: build

deps:
	@bash scripts/install-deps.sh

$(BUILD)/Makefile: CMakeLists.txt
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release

build: deps $(BUILD)/Makefile
	cmake --build $(BUILD) -j $(JOBS)

test: build
	cd $(BUILD) && ctest --output-on-failure --timeout 600

demo: build
	bash scripts/demo.sh

# the binary, libmeshlm.so, include/meshlm/meshlm.h and meshlm.pc under PREFIX
PREFIX ?= /usr/local
install: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=$(PREFIX)
	cmake --build $(BUILD) -j $(JOBS)
	cmake --install $(BUILD)

clean:
	rm -rf $(BUILD)
