"""The process's libnccl through ctypes: unique ids, communicator init/abort/destroy, versions,
and the import-time check that libepx was built against the NCCL this process runs.

One libnccl.so.2 per process: after `import torch`, ctypes.CDLL("libnccl.so.2") returns the copy
torch loaded (the dynamic linker matches the soname of an already loaded library before it
searches any path), and libepx's own reference to libnccl.so.2 resolves to that copy too. So the
communicator EPX gets is torch's NCCL, and it must be the version EPX's headers were.
"""
import ctypes
import sys

from . import _capi, errors

NCCL_UNIQUE_ID_BYTES = 128


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * NCCL_UNIQUE_ID_BYTES)]


_nccl = None


def lib():
    """libnccl.so.2 as loaded in this process (libepx, already loaded by _capi, needs it)."""
    global _nccl
    if _nccl is None:
        n = ctypes.CDLL("libnccl.so.2")
        n.ncclGetUniqueId.argtypes = [ctypes.POINTER(ncclUniqueId)]
        n.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                                       ncclUniqueId, ctypes.c_int]
        n.ncclCommDestroy.argtypes = [ctypes.c_void_p]
        n.ncclCommAbort.argtypes = [ctypes.c_void_p]
        n.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        n.ncclGetErrorString.argtypes = [ctypes.c_int]
        n.ncclGetErrorString.restype = ctypes.c_char_p
        for name in ("ncclGetUniqueId", "ncclCommInitRank", "ncclCommDestroy", "ncclCommAbort",
                     "ncclGetVersion"):
            getattr(n, name).restype = ctypes.c_int  # ncclResult_t
        _nccl = n
    return _nccl


def _check(result, what):
    if result != 0:
        text = lib().ncclGetErrorString(result).decode("utf-8", errors="replace")
        raise errors.EpxNcclError(errors.EPX_ERR_NCCL, "%s: %s (ncclResult_t %d)" %
                                  (what, text, result))


def get_unique_id():
    """A fresh ncclUniqueId as 128 bytes (rank 0 makes it, every rank passes it to init)."""
    uid = ncclUniqueId()
    _check(lib().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES)


def comm_init_rank(num_ranks, unique_id, rank):
    """ncclCommInitRank on the current CUDA device; returns the ncclComm_t as an int."""
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise errors.EpxInvalidArgument(
            errors.EPX_ERR_INVALID_ARGUMENT,
            "ncclCommInitRank: unique id of %d bytes, expected %d" %
            (len(unique_id), NCCL_UNIQUE_ID_BYTES))
    uid = ncclUniqueId()
    ctypes.memmove(ctypes.addressof(uid), unique_id, NCCL_UNIQUE_ID_BYTES)
    comm = ctypes.c_void_p()
    _check(lib().ncclCommInitRank(ctypes.byref(comm), num_ranks, uid, rank), "ncclCommInitRank")
    return comm.value


def comm_destroy(comm):
    _check(lib().ncclCommDestroy(comm), "ncclCommDestroy")


def comm_abort(comm):
    _check(lib().ncclCommAbort(comm), "ncclCommAbort")


def get_version():
    v = ctypes.c_int()
    _check(lib().ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
    return v.value


def version_string(code):
    """NCCL_VERSION_CODE -> "2.28.9" (codes before 2.9 used major*1000 + minor*100)."""
    if code >= 10000:
        return "%d.%d.%d" % (code // 10000, code // 100 % 100, code % 100)
    return "%d.%d.%d" % (code // 1000, code // 100 % 10, code % 100)


def loaded_library_path():
    """The file of the libnccl mapped into this process (from /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)  # address perms offset dev inode [path]
                if len(fields) == 6 and "/libnccl.so" in fields[5]:
                    return fields[5].strip()
    except OSError:
        pass
    return None


def mismatch_message(built, loaded, loaded_path, loaded_by_torch, source_dir=None):
    """The ImportError text when libepx's NCCL headers and the process's NCCL differ."""
    where = loaded_path or "an unknown path"
    owner = " (torch's)" if loaded_by_torch else ""
    return ("libepx was built against NCCL %s but this process loaded NCCL %s from %s%s: "
            "reinstall epx in this environment with `pip install --no-build-isolation "
            "--force-reinstall %s` so it builds against that NCCL, or install "
            "nvidia-nccl-cu13==%s" % (version_string(built), version_string(loaded), where, owner,
                                      source_dir or "<epx source tree>", version_string(built)))


def check_nccl_version(built=None, loaded=None, loaded_path=None, loaded_by_torch=None):
    """Raise ImportError when the NCCL this process loaded is not the one libepx was built
    against (EPX's device structs are NCCL-version specific; epx_group_create would refuse).
    The arguments default to the real values; tests inject their own."""
    if built is None or loaded is None:
        real_built, real_loaded = _capi.nccl_versions()
        built = real_built if built is None else built
        loaded = real_loaded if loaded is None else loaded
    if built == loaded:
        return
    if loaded_path is None:
        loaded_path = loaded_library_path()
    if loaded_by_torch is None:
        loaded_by_torch = "torch" in sys.modules
    repo = _capi._REPO_DIR
    source_dir = None
    if (repo / "Makefile").is_file() and (repo / "include" / "epx.h").is_file():
        source_dir = str(repo)  # running from a source tree: name it
    raise ImportError(mismatch_message(built, loaded, loaded_path, loaded_by_torch, source_dir))
