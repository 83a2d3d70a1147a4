"""Builds libmeshlm.so from the checkout this package sits in and carries it
in the wheel (meshlm/libmeshlm.so), so that `pip install ./python` gives a
binding that needs no MESHLM_LIBRARY.

The library is built with CMake from the repository root (the parent of
this directory, or $MESHLM_SOURCE_DIR) into build-lib/ beside this file,
the library and the CLI only (-DMESHLM_TESTS=OFF); MESHLM_CMAKE_ARGS adds
options (e.g. "-DMESHLM_CUDA=OFF"). Its dependencies (MPI, OpenBLAS, oneDNN, jansson,
PCRE2, utf8proc) must be installed: the configure names a missing one.
The package metadata is pyproject.toml's.
"""

import os
import shlex
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.environ.get("MESHLM_SOURCE_DIR") or os.path.dirname(HERE))


class BuildWithLibrary(build_py):
    """build_py, then the C library into the package's build directory."""

    def run(self):
        super().run()
        build = os.path.join(HERE, "build-lib")
        args = ["cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
                "-DMESHLM_TESTS=OFF"] + shlex.split(os.environ.get("MESHLM_CMAKE_ARGS", ""))
        subprocess.run(args, check=True)
        subprocess.run(["cmake", "--build", build, "--target", "meshlm_shared", "-j",
                        str(os.cpu_count() or 1)], check=True)
        # the real file under the name _lib.py loads (its SONAME link is not needed inside)
        shutil.copyfile(os.path.join(build, "libmeshlm.so"),
                        os.path.join(self.build_lib, "meshlm", "libmeshlm.so"))


class BinaryDistribution(Distribution):
    """A wheel for this platform: it carries a compiled library."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithLibrary}, distclass=BinaryDistribution)
