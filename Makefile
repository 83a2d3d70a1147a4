# Thin wrapper around CMake + CTest.  `make` builds build/meshlm,
# `make test` runs the whole suite, `make demo` runs the main job.
BUILD ?= build
JOBS ?= $(shell nproc)

.PHONY: all deps build test demo clean

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

clean:
	rm -rf $(BUILD)
