# Thin wrapper around CMake + CTest.  `make` builds build/meshlm and
# build/libmeshlm.so with what is installed (a missing library is named with
# its packages) and installs nothing; `make deps` installs what is missing
# (Debian; elsewhere it names the packages). `make test` and `make demo` run
# `make deps` first, so each does everything on a fresh machine.
BUILD ?= build
JOBS ?= $(shell nproc)

.PHONY: all deps build test demo install clean

all: build

deps:
	@bash scripts/install-deps.sh

$(BUILD)/Makefile: CMakeLists.txt
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release

build: $(BUILD)/Makefile
	cmake --build $(BUILD) -j $(JOBS)

test: deps
	$(MAKE) build
	cd $(BUILD) && ctest --output-on-failure --timeout 600

demo: deps
	$(MAKE) build
	bash scripts/demo.sh

# the binary, libmeshlm.so, include/meshlm/ (meshlm.h, meshlm_mpi.h) and meshlm.pc under
# PREFIX; the library and the CLI only (no tests, no benchmarks), built in
# their own directory; on the loader's path when PREFIX's lib directory is
# (else: its RUNPATH finds it from the binary; others set LD_LIBRARY_PATH)
PREFIX ?= /usr/local
INSTALL_BUILD ?= build-install
install:
	cmake -S . -B $(INSTALL_BUILD) -DCMAKE_BUILD_TYPE=Release -DMESHLM_TESTS=OFF \
	  -DCMAKE_INSTALL_PREFIX=$(PREFIX)
	cmake --build $(INSTALL_BUILD) -j $(JOBS)
	cmake --install $(INSTALL_BUILD)
	@if command -v ldconfig > /dev/null && [ -w /etc/ld.so.conf.d ] && \
	  [ "$(PREFIX)" = /usr/local ]; then ldconfig; fi

clean:
	rm -rf $(BUILD) $(INSTALL_BUILD)
