"""The library loads, reports its versions, and every function of epx.h is bound."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

import epx
from epx import _capi

REPO_DIR = pathlib.Path(__file__).resolve().parents[2]
HEADER = REPO_DIR / "include" / "epx.h"


def test_library_loads_from_an_existing_file():
    assert pathlib.Path(_capi.library_path).is_file()


def test_version_matches_package_and_header():
    assert epx.version() == epx.__version__ == "0.1.1"
    assert _capi.library_version() == _capi.EPX_VERSION_CODE == 101
    header = HEADER.read_text()
    parts = [re.search(r"#define EPX_VERSION_%s (\d+)" % p, header).group(1)
             for p in ("MAJOR", "MINOR", "PATCH")]
    assert ".".join(parts) == epx.version()


def test_nccl_version_built_value():
    built = _capi.built_nccl_version()
    assert built >= 22800  # NCCL 2.28 at least: EPX needs its device API
    built_text, loaded_text = epx.nccl_version()
    assert built_text == epx._nccl.version_string(built)
    assert re.fullmatch(r"\d+\.\d+\.\d+", loaded_text)


def test_nccl_version_needs_an_output():
    with pytest.raises(epx.EpxInvalidArgument, match="built and loaded are NULL"):
        _capi.check(_capi.lib.epx_get_nccl_version(None, None))


def test_status_strings_come_from_the_library():
    assert _capi.status_string(0) == "success"
    assert "epx_last_error" in _capi.status_string(epx.errors.EPX_ERR_INVALID_ARGUMENT)


def test_every_header_function_has_a_prototype():
    declared = set(re.findall(r"^(?:epx_status_t|const char \*)\s*(epx_\w+)\(",
                              HEADER.read_text(), re.M))
    assert declared == set(_capi.PROTOTYPES)


def test_missing_library_names_the_paths_tried(tmp_path):
    missing = tmp_path / "nowhere" / "libepx.so"
    env = dict(os.environ, EPX_LIBRARY=str(missing), PYTHONPATH=str(REPO_DIR / "python"))
    code = "import epx._capi"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert p.returncode != 0
    assert "ImportError" in p.stderr and str(missing) in p.stderr
