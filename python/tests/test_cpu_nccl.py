"""The import-time NCCL version check, with injected versions (no GPU)."""
import pytest

from epx import _nccl


def test_version_strings():
    assert _nccl.version_string(22809) == "2.28.9"
    assert _nccl.version_string(22703) == "2.27.3"
    assert _nccl.version_string(2804) == "2.8.4"  # before 2.9: major*1000 + minor*100


def test_equal_versions_pass():
    _nccl.check_nccl_version(built=22809, loaded=22809)


def test_mismatch_names_both_versions_the_path_and_the_fix():
    with pytest.raises(ImportError) as info:
        _nccl.check_nccl_version(built=22809, loaded=22703,
                                 loaded_path="/venv/nvidia/nccl/lib/libnccl.so.2",
                                 loaded_by_torch=True)
    text = str(info.value)
    assert text.startswith("libepx was built against NCCL 2.28.9 but this process loaded NCCL "
                           "2.27.3 from /venv/nvidia/nccl/lib/libnccl.so.2 (torch's): ")
    assert "pip install --no-build-isolation --force-reinstall" in text
    assert "nvidia-nccl-cu13==2.28.9" in text


def test_mismatch_message_without_torch_or_path():
    text = _nccl.mismatch_message(22809, 22901, None, False, "/src/epx")
    assert "NCCL 2.29.1 from an unknown path:" in text and "(torch's)" not in text
    assert "--force-reinstall /src/epx`" in text


def test_real_versions_agree_in_this_process():
    _nccl.check_nccl_version()  # what `import epx` ran


def test_loaded_library_path_found_once_nccl_is_loaded():
    _nccl.lib()  # libepx already pulled libnccl.so.2 in; this binds it
    path = _nccl.loaded_library_path()
    assert path is not None and "libnccl.so" in path
    assert _nccl.get_version() >= 22800


def test_unique_id_needs_no_gpu():
    uid = _nccl.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == _nccl.NCCL_UNIQUE_ID_BYTES
