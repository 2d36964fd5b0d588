"""EPX's exceptions: one class per epx_status_t, and the asynchronous-error record.

Needs neither the library nor torch, so the mapping is testable anywhere. Every EPX failure
raises an EpxError subclass carrying the C status, its name and EPX's message (epx_last_error).
"""

# epx_status_t values, as include/epx.h's EPX_STATUS_MAP lists them.
EPX_OK = 0
EPX_ERR_CUDA = 1
EPX_ERR_NCCL = 2
EPX_ERR_SYSTEM = 3
EPX_ERR_INTERNAL = 4
EPX_ERR_INVALID_ARGUMENT = 5
EPX_ERR_INVALID_USAGE = 6
EPX_ERR_TIMEOUT = 7
EPX_ERR_PEER_FAILED = 8
EPX_ERR_UNSUPPORTED = 9
EPX_ERR_PEER_DATA = 10

STATUS_NAMES = {
    EPX_OK: "EPX_OK",
    EPX_ERR_CUDA: "EPX_ERR_CUDA",
    EPX_ERR_NCCL: "EPX_ERR_NCCL",
    EPX_ERR_SYSTEM: "EPX_ERR_SYSTEM",
    EPX_ERR_INTERNAL: "EPX_ERR_INTERNAL",
    EPX_ERR_INVALID_ARGUMENT: "EPX_ERR_INVALID_ARGUMENT",
    EPX_ERR_INVALID_USAGE: "EPX_ERR_INVALID_USAGE",
    EPX_ERR_TIMEOUT: "EPX_ERR_TIMEOUT",
    EPX_ERR_PEER_FAILED: "EPX_ERR_PEER_FAILED",
    EPX_ERR_UNSUPPORTED: "EPX_ERR_UNSUPPORTED",
    EPX_ERR_PEER_DATA: "EPX_ERR_PEER_DATA",
}

# epx_stage_t values (where an asynchronous error happened).
STAGE_NAMES = {
    0: "EPX_STAGE_NONE",
    1: "EPX_STAGE_LAYOUT",
    2: "EPX_STAGE_BARRIER",
    3: "EPX_STAGE_NOTIFY",
    4: "EPX_STAGE_DISPATCH",
    5: "EPX_STAGE_COMBINE",
    6: "EPX_STAGE_LL_DISPATCH",
    7: "EPX_STAGE_LL_COMBINE",
}


def status_name(status):
    return STATUS_NAMES.get(int(status), "EPX_STATUS_%d" % int(status))


class EpxError(RuntimeError):
    """A failed EPX call: .status (epx_status_t), .status_name, .message (EPX's text)."""

    def __init__(self, status, message):
        self.status = int(status)
        self.status_name = status_name(status)
        self.message = message or ""
        super().__init__("%s (%s)" % (self.message, self.status_name))

    def __str__(self):
        return "%s (%s)" % (self.message, self.status_name)

    def __reduce__(self):  # picklable across processes (multiprocessing, torch.multiprocessing)
        return (error_for, (self.status, self.message))


class EpxInvalidArgument(EpxError, ValueError):
    """EPX_ERR_INVALID_ARGUMENT, also raised by the Python-side tensor checks."""


class EpxInvalidUsage(EpxError):
    """EPX_ERR_INVALID_USAGE: wrong order, destroyed object, mismatched ranks."""


class EpxTimeout(EpxError, TimeoutError):
    """EPX_ERR_TIMEOUT: a wait on a peer ran past timeout_ms."""


class EpxPeerFailed(EpxError):
    """EPX_ERR_PEER_FAILED: a peer stopped answering and was masked."""


class EpxPeerData(EpxError):
    """EPX_ERR_PEER_DATA: a peer's rows were not valid (a step failed there) and were left out."""


class EpxUnsupported(EpxError, NotImplementedError):
    """EPX_ERR_UNSUPPORTED: beyond the compiled limits or the machine."""


class EpxCudaError(EpxError):
    """EPX_ERR_CUDA."""


class EpxNcclError(EpxError):
    """EPX_ERR_NCCL (also NCCL calls made by the Python package itself)."""


class EpxSystemError(EpxError):
    """EPX_ERR_SYSTEM."""


class EpxInternalError(EpxError):
    """EPX_ERR_INTERNAL."""


_CLASS_OF_STATUS = {
    EPX_ERR_CUDA: EpxCudaError,
    EPX_ERR_NCCL: EpxNcclError,
    EPX_ERR_SYSTEM: EpxSystemError,
    EPX_ERR_INTERNAL: EpxInternalError,
    EPX_ERR_INVALID_ARGUMENT: EpxInvalidArgument,
    EPX_ERR_INVALID_USAGE: EpxInvalidUsage,
    EPX_ERR_TIMEOUT: EpxTimeout,
    EPX_ERR_PEER_FAILED: EpxPeerFailed,
    EPX_ERR_UNSUPPORTED: EpxUnsupported,
    EPX_ERR_PEER_DATA: EpxPeerData,
}


def error_for(status, message):
    """The exception for a status (the base EpxError for EPX_OK or an unknown code)."""
    return _CLASS_OF_STATUS.get(int(status), EpxError)(status, message)


class AsyncError:
    """An error a kernel recorded (epx_async_error_t): status, stage (name), peer, position,
    value, message. Read with Group.async_error() after synchronizing the stream."""

    __slots__ = ("status", "stage", "peer", "position", "value", "message")

    def __init__(self, status, stage, peer, position, value, message):
        self.status = int(status)
        self.stage = stage if isinstance(stage, str) else STAGE_NAMES.get(int(stage), str(stage))
        self.peer = int(peer)
        self.position = int(position)
        self.value = int(value)
        self.message = message

    @property
    def status_name(self):
        return status_name(self.status)

    def error(self):
        """The exception this record stands for (what Group.check_async_error raises)."""
        return error_for(self.status, self.message)

    def __repr__(self):
        return "AsyncError(%s, stage=%s, peer=%d, position=%d, value=%d, message=%r)" % (
            self.status_name, self.stage, self.peer, self.position, self.value, self.message)
