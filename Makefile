# Thin wrapper around CMake + CTest.  `make` builds build/meshlm and
# build/libmeshlm.so with what is installed (a missing library is named with
# its packages) and installs nothing; `make deps` installs what is missing
# (Debian; elsewhere it names the packages). `make test` and `make demo` run
# `make deps` first, so each does everything on a fresh machine.
BUILD ?= build
JOBS ?= $(shell nproc)

.PHONY: all deps build test test-mpich demo install clean

all: build

deps:
	@bash scripts/install-deps.sh

$(BUILD)/Makefile: CMakeLists.txt
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release

build: $(BUILD)/Makefile
	cmake --build $(BUILD) -j $(JOBS)

test: deps
	$(MAKE) build
	cd $(BUILD) && ctest --output-on-failure --timeout 600 -j $(JOBS)

# The suite again against MPICH (Open MPI stays the default MPI) in its own
# build directory, CUDA off: every MPI test (C, API, CLI, Python) with
# MPICH's mpiexec; the second OpenBLAS-kernel runs (label blas_alt) and the
# CUDA ones only under the default build. MPICH_CC / MPICH_EXEC name other
# MPICH programs (RHEL: /usr/lib64/mpich/bin/mpicc, .../mpiexec);
# MPICH_CTEST_ARGS selects other tests (CI: .ci/run).
MPICH_CC ?= mpicc.mpich
MPICH_EXEC ?= mpiexec.mpich
MPICH_CTEST_ARGS ?= -LE 'blas_alt|cuda'
test-mpich:
	@bash scripts/install-deps.sh --mpich
	cmake -S . -B $(BUILD)-mpich -DCMAKE_BUILD_TYPE=Release -DMESHLM_CUDA=OFF \
	  -DMPI_C_COMPILER=$$(command -v $(MPICH_CC)) -DMPIEXEC_EXECUTABLE=$$(command -v $(MPICH_EXEC))
	cmake --build $(BUILD)-mpich -j $(JOBS)
	cd $(BUILD)-mpich && ctest --output-on-failure --timeout 600 -j $(JOBS) $(MPICH_CTEST_ARGS)

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
