"""pytest setup of the Python package's tests: run them against this source tree's package
(python/epx), which loads libepx from $EPX_LIBRARY, the package's _lib/ or build/lib/ (make lib).

test_cpu_*.py need no GPU (CI runs them); test_gpu_*.py need GPUs and skip without them.
"""
import pathlib
import sys

REPO_DIR = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_DIR / "python"))
