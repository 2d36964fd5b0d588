"""EPX for PyTorch: expert-parallel dispatch/combine for MoE over NVLink (docs/python.md).

The package wraps libepx (include/epx.h) through ctypes. `import epx` needs no torch (only the
library): workspace_size, version and the errors work anywhere. When torch is installed it is
imported first, so that the NCCL it loads is the process's one, and the import fails with the
fix when libepx was built against another NCCL version.
"""
import importlib.util

if importlib.util.find_spec("torch") is not None:
    import torch  # noqa: F401  (loads torch's libnccl.so.2 before libepx needs one)

    _TORCH = True
else:
    _TORCH = False

from . import _capi, _nccl, errors  # noqa: E402
from .errors import (AsyncError, EpxCudaError, EpxError, EpxInternalError,  # noqa: E402
                     EpxInvalidArgument, EpxInvalidUsage, EpxNcclError, EpxPeerData,
                     EpxPeerFailed, EpxSystemError, EpxTimeout, EpxUnsupported, error_for)
from .group import (DispatchResult, ExpandResult, Group, Handle, Hook, Layout,  # noqa: E402
                    LLDispatchResult, workspace_size)
from .experts import Experts  # noqa: E402
from .moe_prefill import MoePrefill  # noqa: E402

__version__ = "0.1.1"

if _TORCH:
    _nccl.check_nccl_version()


def version():
    """The version of the loaded libepx, e.g. "0.1.1"."""
    return _capi.version_string(_capi.library_version())


def nccl_version():
    """(built, loaded): the NCCL libepx was compiled against and the one this process runs,
    as version strings, e.g. ("2.28.9", "2.28.9")."""
    built, loaded = _capi.nccl_versions()
    return _nccl.version_string(built), _nccl.version_string(loaded)


__all__ = [
    "AsyncError", "DispatchResult", "EpxCudaError", "EpxError", "EpxInternalError",
    "EpxInvalidArgument", "EpxInvalidUsage", "EpxNcclError", "EpxPeerData", "EpxPeerFailed",
    "EpxSystemError",
    "EpxTimeout", "EpxUnsupported", "ExpandResult", "Experts", "Group", "Handle", "Hook",
    "Layout", "LLDispatchResult", "MoePrefill", "error_for", "errors", "nccl_version", "version",
    "workspace_size",
]
