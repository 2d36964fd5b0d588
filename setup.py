"""setup.py - the build step of the EPX Python package (metadata: pyproject.toml).

build_py also runs `make lib PYTHON=<this python>` in the source tree and copies
build/lib/libepx.so into the package as epx/_lib/libepx.so. PYTHON= makes mk/toolchain.mk find
the nvidia-nccl-cu13 wheel of this environment (when the CUDA toolkit has no NCCL), which is why
the install must run with --no-build-isolation (see pyproject.toml).
"""
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))
LIBRARY = os.path.join(ROOT, "build", "lib", "libepx.so")


class BuildPyWithLibrary(build_py):
    """The Python sources, plus libepx.so built by make."""

    def run(self):
        super().run()
        jobs = os.environ.get("EPX_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.run(["make", "-C", ROOT, "-j" + jobs, "lib", "PYTHON=" + sys.executable],
                       check=True)
        target = os.path.join(self.build_lib, "epx", "_lib")
        os.makedirs(target, exist_ok=True)
        shutil.copy2(LIBRARY, os.path.join(target, "libepx.so"))


class BinaryDistribution(Distribution):
    """The wheel holds a native library: tag it for this platform and Python, not 'any'."""

    def has_ext_modules(self):
        return True


setup(
    package_dir={"": "python"},
    cmdclass={"build_py": BuildPyWithLibrary},
    distclass=BinaryDistribution,
    # make owns build/lib (libepx.so, libepx.a): setuptools works under build/python instead.
    options={"build": {"build_base": os.path.join("build", "python")}},
)
