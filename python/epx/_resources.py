"""Native lifetime: who owns the epx_group_t, its ncclComm_t and each epx_handle_t, and what
destroy() or the garbage collector releases.

_GroupResources owns the group (and the communicator EPX created, unless borrowed);
_HandleResources owns one handle and keeps its group's resources alive; Handle is the Python
object of an epx_handle_t (Group.handle() makes one). Views of the workspace
keep these alive, not the Group or Handle objects, so a dropped Group with no views left is
collected. Releasing a group is collective (epx_group_destroy), whether destroy() or the GC
triggers it; never at interpreter exit (the finalizers have atexit off). Calls go through
_capi.lib at call time.
"""
import ctypes
import weakref

from . import _capi, _nccl, errors


class _HandleState:
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


def _release_handle(state, group_state):
    if state.ptr is None:
        return None
    ptr, state.ptr = state.ptr, None
    group_state["handles"].discard(state)
    if group_state["group"] is None:
        return None  # the group's destroy released it first
    status = _capi.lib.epx_handle_destroy(ptr)
    return None if status == errors.EPX_OK else errors.error_for(status, _capi.last_error())


def borrowed_comm_gone(state, fn):
    """The error for a call on a group whose borrowed communicator's process group was destroyed
    first (torch destroyed the communicator, and with it what EPX registered on it), else None."""
    alive = state["comm_alive"]
    if alive is None or alive():
        return None
    return errors.EpxInvalidUsage(
        errors.EPX_ERR_INVALID_USAGE,
        "%s: the process group whose NCCL communicator this group borrowed "
        "(borrow_nccl_comm=True) was destroyed before the group; the group can no longer be "
        "used, and its memory is left allocated (destroy the EPX group before "
        "torch.distributed.destroy_process_group)" % fn)


def _release_group(state):
    """Handles, then the group (collective), then the communicator EPX created. Returns the
    first error instead of raising (a GC callback has nobody to raise to)."""
    if state["group"] is None:
        return None
    gone = borrowed_comm_gone(state, "Group.destroy")
    state["comm_alive"] = None  # (it holds the process group; nothing checks it from here on)
    if gone is not None:
        # epx_group_destroy would release memory registered on a communicator that no longer
        # exists: leave it all (a leak, reported) rather than touch freed NCCL state.
        state["group"] = None
        for h in list(state["handles"]):
            h.ptr = None
        state["handles"].clear()
        return gone
    first = None
    for h in list(state["handles"]):
        err = _release_handle(h, state)  # every handle, whichever failed before
        first = first or err
    gptr, state["group"] = state["group"], None
    status = _capi.lib.epx_group_destroy(gptr)
    if status != errors.EPX_OK:
        first = first or errors.error_for(status, _capi.last_error())
    if state["owns_comm"] and state["comm"]:
        try:  # a failed group destroy may leave peers out of step: abort, which never waits
            (_nccl.comm_destroy if status == errors.EPX_OK else _nccl.comm_abort)(state["comm"])
        except errors.EpxError as e:
            first = first or e
    state["comm"] = None
    return first


class _GroupResources:
    """Owns the epx_group_t and (unless borrowed) the ncclComm_t. Views of the workspace keep
    this alive, not the Group, so a dropped Group with no views left is collected."""

    def __init__(self, gptr, comm, owns_comm, comm_alive=None):
        # comm_alive: for a borrowed communicator, whether its process group still exists
        self.state = {"group": gptr, "comm": comm, "owns_comm": owns_comm, "handles": set(),
                      "comm_alive": comm_alive}
        self.release = weakref.finalize(self, _release_group, self.state)
        self.release.atexit = False  # never a collective while the interpreter shuts down


class _HandleResources:
    def __init__(self, group_res, hptr):
        self.group_res = group_res  # the group outlives its handles
        self.state = _HandleState(hptr)
        group_res.state["handles"].add(self.state)
        self.release = weakref.finalize(self, _release_handle, self.state, group_res.state)
        self.release.atexit = False


class Handle:
    """The routing of one normal dispatch (epx_handle_create), reused by combine and
    dispatch_cached. Released by destroy(), by garbage collection, or with its group."""

    def __init__(self, group):
        hptr = ctypes.c_void_p()
        _capi.check(_capi.lib.epx_handle_create(group._ptr(), ctypes.byref(hptr)))
        self._group = group  # a handle keeps its group alive
        self._res = _HandleResources(group._res, hptr.value)
        self._views = {}
        self.num_tokens = None  # of the dispatch that filled it (None: no dispatch yet)
        self.num_recv = -1  # its receive count when known on the host
        self.num_worst_tokens = 0
        self.num_rows = -1  # expert-major rows of its dispatch_expand, when known on the host
        self._recv_x_ptr = self._recv_weights_ptr = None

    def _ptr(self, fn):
        ptr = self._res.state.ptr
        if ptr is None:
            raise errors.EpxInvalidUsage(errors.EPX_ERR_INVALID_USAGE,
                                         "%s: the handle was destroyed" % fn)
        return ptr

    def destroy(self):
        """Release the handle (idempotent; synchronizes the device)."""
        self._views.clear()
        err = self._res.release()
        if err is not None:
            raise err

    def __repr__(self):
        return "Handle(num_tokens=%s, destroyed=%s)" % (self.num_tokens,
                                                        self._res.state.ptr is None)

