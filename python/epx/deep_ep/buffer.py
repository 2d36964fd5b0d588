"""``Buffer``: DeepEP V1's ``deep_ep.Buffer`` implemented on EPX's native API (``epx.Group``).

What maps to what
-----------------
* Normal mode (``get_dispatch_layout``, ``dispatch``, ``combine``) runs on an ``epx.Group`` created
  with ``modes=("normal",)``; low-latency mode (``low_latency_dispatch`` / ``_combine``) on a
  second one with ``modes=("low_latency",)``. Each group owns its NCCL communicator and its
  symmetric workspace; the normal one is sized within ``num_nvl_bytes``, the low-latency one
  within ``num_rdma_bytes`` (on one host that is DeepEP's low-latency budget, and
  ``get_low_latency_rdma_size_hint`` returns EPX's size for it).
* DeepEP's Buffer never learns the shapes an EPX group needs (tokens per rank, hidden, experts,
  top-k), so groups are created lazily, collectively, by the first call that needs one. Every
  rank makes the same calls in the same order (DeepEP requires it too), so every rank creates
  the same groups at the same point. A Buffer holds at most one group per mode: a call with
  other shapes (another hidden, expert count or top-k in normal mode; another
  ``num_max_dispatch_tokens_per_rank`` / hidden / experts / top-k in low-latency mode) destroys it
  and creates a new one, which invalidates the handles and low-latency outputs of the old one.
* ``get_dispatch_layout`` knows no hidden size. If it comes first, the normal group it creates is
  a small layout-only one (hidden 8); the first dispatch replaces it by the real one (a one-time
  cost of a second group creation). Later layouts use the real group.
* The normal group's ``max_tokens_per_rank`` is the largest count (at most 65536) whose
  ``epx.workspace_size`` fits ``num_nvl_bytes``, so later, larger batches need no new group; if
  even the largest batch any rank passes does not fit, the call raises naming num_nvl_bytes.

Semantics kept from DeepEP
--------------------------
* Streams: normal-mode operations run on the Buffer's communication stream, which first waits
  for ``previous_event`` (else for the current stream); ``async_finish=True`` returns an
  EventOverlap on the communication stream (the tensors used across streams are
  ``record_stream``-ed), otherwise the current stream waits for the communication stream before
  the call returns. ``allocate_on_comm_stream`` allocates the outputs on the communication
  stream. Low-latency operations run on the current stream (``async_finish`` gives an event
  there, ``return_recv_hook`` a hook that completes the receive on the stream of the call).
* ``dispatch`` returns fresh tensors that stay valid, like DeepEP's. EPX itself hands out views
  of its workspace, valid until the next dispatch: this module copies them (see ``_fresh_copies``);
  ``epx.Group`` is the zero-copy API.
* Handles: a normal dispatch returns a tuple shaped as DeepEP's intranode handle,
  ``(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
  is_token_in_rank, send_head)``; the channel matrices and ``send_head`` are None (EPX has no
  channels). Each dispatch gets its own EPX handle (callers keep old handles for a later
  combine or cached dispatch), taken from a pool and given back when the Python handle dies.
  A low-latency dispatch returns ``(recv_src_info [L, R*M] int32 source token index,
  layout_range [L, R] int64, num_max_dispatch_tokens_per_rank, hidden, num_experts)``.

Refused (NotImplementedError naming the feature): more than one host / internode RDMA, MNNVL and
fabric memory, LogFMT combine, NVFP4 dispatch, mpi4py communicators, groups outside 1..8 ranks.
Accepted and ignored: ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``, every
``Config`` (chunk sizes and SM count; the SM count of the normal group is ``Buffer.num_sms`` at
its creation), ``num_tokens_per_rdma_rank``, ``dispatch_wait_recv_cost_stats`` and
``combine_wait_recv_cost_stats`` (left untouched: EPX has no per-rank wait clock).
"""

import operator
import socket
import weakref
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..errors import EpxInvalidArgument
from .config import Config
from .utils import (EPX_MAX_RANKS, EPX_MAX_TOKENS_PER_RANK, EPX_MAX_TOP_K, EventHandle, EventOverlap,
                    as_cuda_event, core, current_stream, new_stream, record_stream, stream_ctx)

# Hidden size of the layout-only normal group (see the module docstring): the smallest EPX takes.
LAYOUT_ONLY_HIDDEN = 8


class DispatchHandle(tuple):
    """The handle of a normal-mode dispatch, shaped as DeepEP's intranode handle:
    ``(rank_prefix_matrix [R, R] int32, channel_prefix_matrix (None), recv_channel_prefix_matrix
    (None), recv_src_idx [N] int32, is_token_in_rank [T, R] bool (the caller's, or None),
    send_head (None))``. It keeps the EPX handle that recorded the routing (``epx_handle``);
    ``num_recv`` is the number of received rows (``num_worst_tokens`` when that was given)."""

    FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
              "is_token_in_rank", "send_head")

    def __new__(cls, rank_prefix_matrix, recv_src_idx, is_token_in_rank, *, lease=None, num_recv=0,
                num_tokens=0, num_worst_tokens=0):
        self = super().__new__(cls, (rank_prefix_matrix, None, None, recv_src_idx, is_token_in_rank, None))
        self._lease = lease
        self.num_recv = int(num_recv)
        self.num_tokens = int(num_tokens)
        self.num_worst_tokens = int(num_worst_tokens)
        return self

    @property
    def epx_handle(self):
        """The epx.Handle holding this dispatch's routing (None once released)."""
        return None if self._lease is None else self._lease.handle


class LowLatencyHandle(tuple):
    """The handle of a low-latency dispatch, shaped as DeepEP's: ``(recv_src_info [L, R*M] int32
    (source token of each row; a strided view of EPX's [L, R*M, 4] array), layout_range [L, R]
    int64 ((begin << 32) | count per local expert and source), num_max_dispatch_tokens_per_rank,
    hidden, num_experts)``. ``epx_result`` is the epx.LLDispatchResult that combine needs."""

    FIELDS = ("recv_src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts")

    def __new__(cls, recv_src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts, *,
                result=None, state=None):
        self = super().__new__(cls, (recv_src_info, layout_range, int(num_max_dispatch_tokens_per_rank),
                                     int(hidden), int(num_experts)))
        self.epx_result = result
        self._state = state
        return self


class _Lease:
    """An EPX handle lent to one DispatchHandle; finalized (and the handle given back to its
    group's pool) when the DispatchHandle, its only owner, dies."""

    __slots__ = ("state", "handle", "__weakref__")

    def __init__(self, state, handle):
        self.state = state
        self.handle = handle
        # A handle whose dispatch is being captured in a CUDA graph is written again by every
        # replay: it never goes back to the pool, so no eager dispatch can take it (and have its
        # routing overwritten by a replay before its combine) while the graph may still run.
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return
        fin = weakref.finalize(self, state.give_back, handle)
        fin.atexit = False


class _GroupState:
    """One epx.Group of a Buffer: its shapes, and (normal mode) its pool of EPX handles."""

    def __init__(self, group, owner_id: int, mode: str, hidden: int, num_experts: int, top_k: int,
                 max_tokens: int, provisional: bool = False):
        self.group = group
        self.owner_id = owner_id
        self.mode = mode
        self.hidden = hidden
        self.num_experts = num_experts
        self.top_k = top_k
        self.max_tokens = max_tokens
        self.provisional = provisional  # normal mode: layout-only group (hidden unknown yet)
        self.alive = True
        self._handles = []  # every EPX handle created (kept alive: Group.destroy releases them)
        self._pool = []  # the ones no DispatchHandle holds
        self._source_tokens = {}  # low-latency mode: recv_src_info address -> its [..., 1] view

    def source_tokens(self, recv_src_info: torch.Tensor) -> torch.Tensor:
        """The source-token column of a low-latency dispatch's recv_src_info [L, R*M, 4]: a
        strided [L, R*M] view, made once per receive buffer (there are two, at fixed addresses)."""
        key = (recv_src_info.data_ptr(), tuple(recv_src_info.shape))
        view = self._source_tokens.get(key)
        if view is None:
            if len(self._source_tokens) >= 4:  # two buffers; anything else is not worth keeping
                self._source_tokens.clear()
            view = self._source_tokens[key] = recv_src_info[..., 1]
        return view

    def serves(self, num_experts: int, hidden: Optional[int], top_k: Optional[int]) -> bool:
        """Whether this normal group can run a call of these shapes (None: any)."""
        if num_experts != self.num_experts:
            return False
        if hidden is not None and (self.provisional or hidden != self.hidden):
            return False
        return top_k is None or top_k == self.top_k

    def take_handle(self):
        if self._pool:
            return self._pool.pop()
        handle = self.group.handle()
        self._handles.append(handle)
        return handle

    def give_back(self, handle) -> None:
        # All EPX operations of a Buffer's normal group run on its one communication stream, so a
        # dispatch that reuses this handle is ordered after every use of it.
        if self.alive:
            self._pool.append(handle)

    def destroy(self) -> None:
        """Destroy the handles, then the group. Collective (epx group destruction)."""
        if not self.alive:
            return
        self.alive = False
        self._source_tokens.clear()
        self._handles, self._pool = [], []
        # Group.destroy releases every handle (going on after a failure) before the collective
        # group destroy: a handle failing here must not keep this rank out of that collective.
        self.group.destroy()


def fit_max_tokens(size_of: Callable[[int], int], budget: int, need: int,
                   limit: int = EPX_MAX_TOKENS_PER_RANK) -> Optional[int]:
    """The largest m in [need, limit] with size_of(m) <= budget (size_of non-decreasing), or
    None when even size_of(need) exceeds the budget."""
    need = max(1, int(need))
    if need > limit or size_of(need) > budget:
        return None
    lo, hi = need, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if size_of(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _layout_in_torch(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """EPX's layout (tests/ref: a token counts once per expert and rank it lists; ids outside
    [0, E) are empty slots) in torch, for more tokens than the group holds: (num_tokens_per_rank
    [R] int32, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)."""
    T, E = topk_idx.size(0), num_experts
    ids = topk_idx.long()
    ids = torch.where((ids >= 0) & (ids < E), ids, torch.full_like(ids, E))  # E: the empty slot
    listed = torch.zeros(T, E + 1, dtype=torch.bool, device=topk_idx.device).scatter_(1, ids, True)[:, :E]
    in_rank = listed.view(T, num_ranks, E // num_ranks).any(2)
    return in_rank.sum(0, dtype=torch.int32), listed.sum(0, dtype=torch.int32), in_rank


def _split_x(x) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"x: a tuple must be (x_fp8, x_scales), got {len(x)} elements")
        return x[0], x[1]
    return x, None


def _recv_scales(result) -> torch.Tensor:
    """The received FP8 scales of a dispatch result: float32 [N, H/128] or packed UE8M0 int32."""
    scales = result.recv_x_scales
    if scales is None:
        scales = getattr(result, "recv_x_scales_packed", None)
    if scales is None:
        raise RuntimeError("EPX returned no receive scales for an FP8 dispatch")
    return scales


def _bias_arg(bias):
    """DeepEP's bias (None, a tensor, or a pair) as epx.Group.combine takes it."""
    if bias is None or isinstance(bias, torch.Tensor):
        return bias
    if isinstance(bias, (tuple, list)):
        if len(bias) != 2:
            raise ValueError(f"Buffer.combine: bias: expected a tensor or a pair of tensors, got {len(bias)} elements")
        given = [b for b in bias if b is not None]
        if not given:
            return None
        return given[0] if len(given) == 1 else (given[0], given[1])
    raise TypeError(f"Buffer.combine: bias: expected a tensor or a pair of tensors, got {type(bias).__name__}")


class _CommCall:
    """The stream protocol of one normal-mode call (DeepEP's): the communication stream waits for
    previous_event (else the current stream); outputs are allocated on the current stream, or on
    the communication stream with allocate_on_comm_stream; finish() returns the EventOverlap."""

    def __init__(self, fn: str, comm, previous_event, async_finish: bool, allocate_on_comm_stream: bool):
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError(f"Buffer.{fn}: allocate_on_comm_stream=True needs previous_event and async_finish=True")
        self.comm = comm
        self.compute = current_stream()
        self.async_finish = bool(async_finish)
        self.on_comm = bool(allocate_on_comm_stream)
        self.alloc_stream = comm if self.on_comm else self.compute
        self.tensors: List[Optional[torch.Tensor]] = []  # used on the communication stream
        event = as_cuda_event(previous_event)
        if event is not None:
            comm.wait_event(event)
        else:
            comm.wait_stream(self.compute)

    def finish(self) -> EventOverlap:
        if not self.async_finish:
            self.compute.wait_stream(self.comm)
            return EventOverlap(None)
        for t in self.tensors:
            if isinstance(t, torch.Tensor):
                record_stream(t, self.comm)
                if self.on_comm:
                    record_stream(t, self.compute)
        return EventOverlap(EventHandle(self.comm))


class Buffer:
    """DeepEP V1's communication buffer, on EPX (one host, 1..8 GPUs on NVLink).

    Attributes (as DeepEP's): ``num_sms`` (class-wide SM budget of normal-mode kernels, read when
    the normal group is created; default 24), ``rank``, ``group_size``, ``group``,
    ``num_nvl_bytes`` (normal-mode workspace budget), ``num_rdma_bytes`` (low-latency workspace
    budget on one host), ``low_latency_mode``, ``explicitly_destroy``, ``enable_shrink``.
    """

    num_sms: int = 24

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Optional[object] = None) -> None:  # comm: an mpi4py.MPI.Comm in DeepEP
        # Argument refusals first: they need neither torch.distributed nor a GPU.
        if allow_mnnvl:
            raise NotImplementedError("Buffer: allow_mnnvl=True: multi-node NVLink (MNNVL) is not supported by EPX "
                                      "(one host only)")
        if use_fabric:
            raise NotImplementedError("Buffer: use_fabric=True: fabric memory handles are not supported by EPX "
                                      "(its workspace is NCCL symmetric memory on one host)")
        if group is None:
            if comm is None:
                raise ValueError("Buffer: either 'group' or 'comm' must be provided")
            raise NotImplementedError("Buffer: an mpi4py communicator ('comm') is not supported: pass a "
                                      "torch.distributed process group as 'group'")
        sizes = {}
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            try:
                sizes[name] = operator.index(value)
            except TypeError:
                sizes[name] = -1
            if isinstance(value, bool) or sizes[name] < 0:
                raise ValueError(f"Buffer: {name} = {value!r}: must be a non-negative int")
        num_nvl_bytes, num_rdma_bytes = sizes["num_nvl_bytes"], sizes["num_rdma_bytes"]
        del num_qps_per_rank, allow_nvlink_for_low_latency_mode  # RDMA / NVSHMEM settings: nothing here

        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        if not 1 <= self.group_size <= EPX_MAX_RANKS:
            raise NotImplementedError(f"Buffer: the group has {self.group_size} ranks: EPX groups have 1..{EPX_MAX_RANKS} "
                                      f"ranks on one host")
        self._check_one_host()

        self._comm_stream = new_stream()
        self._normal: Optional[_GroupState] = None
        self._ll: Optional[_GroupState] = None
        self._destroyed = False

    def _check_one_host(self) -> None:
        # Every rank gathers (a rank that decided alone, say from its own visible GPU count,
        # would leave the others waiting in the gather), then all decide the same.
        seen = [None] * self.group_size
        dist.all_gather_object(seen, (socket.gethostname(), torch.cuda.device_count()), group=self.group)
        multi = len({host for host, _ in seen}) > 1 or any(self.group_size > n for _, n in seen)
        if multi:
            what = "internode RDMA (num_rdma_bytes > 0 across hosts)" if self.num_rdma_bytes > 0 and \
                not self.low_latency_mode else "communication across hosts"
            raise NotImplementedError(f"Buffer: the group spans more than one host: {what} is not supported by EPX "
                                      f"(one host, NVLink only)")

    # ------------------------------------------------------------------------------------------
    # Class-wide settings and hints
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """True: EPX's kernels are built for SM90 (FP8 payloads are available)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM budget of normal-mode kernels (even, as DeepEP requires). It applies to
        normal groups created afterwards: an existing group keeps the budget it was created with."""
        if not isinstance(new_num_sms, int) or isinstance(new_num_sms, bool):
            raise TypeError(f"Buffer.set_num_sms: expected an int, got {type(new_num_sms).__name__}")
        if new_num_sms <= 0 or new_num_sms % 2 != 0:
            raise ValueError(f"Buffer.set_num_sms: {new_num_sms}: the SM count must be positive and even")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An EventOverlap of an event recorded now on the current stream."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of a low-latency-only EPX group's workspace per GPU (``epx.workspace_size`` with
        ``modes=("low_latency",)``) for this many tokens per rank, at the largest top-k EPX
        supports (the size grows with top-k, which the hint is not told). Pass it as
        ``num_rdma_bytes``. Needs the EPX library, not a GPU."""
        if num_ranks > EPX_MAX_RANKS:
            raise NotImplementedError(f"Buffer.get_low_latency_rdma_size_hint: num_ranks = {num_ranks}: EPX groups "
                                      f"span one host of at most {EPX_MAX_RANKS} GPUs")
        tokens = int(num_max_dispatch_tokens_per_rank)
        sizes = core().workspace_size(int(num_ranks), tokens, int(hidden), int(num_experts),
                                      min(EPX_MAX_TOP_K, int(num_experts)), modes=("low_latency",),
                                      ll_max_tokens_per_rank=tokens)
        return int(sizes["total"])

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """A Config for DeepEP callers. EPX ignores its fields (see epx.deep_ep.config)."""
        if int(num_ranks) < 1:
            raise ValueError(f"Buffer.get_dispatch_config: num_ranks = {num_ranks}: must be positive")
        return Config(Buffer.num_sms, 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """A Config for DeepEP callers. EPX ignores its fields (see epx.deep_ep.config)."""
        if int(num_ranks) < 1:
            raise ValueError(f"Buffer.get_combine_config: num_ranks = {num_ranks}: must be positive")
        return Config(Buffer.num_sms, 4, 256, 6, 128)

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The communication stream of normal-mode calls."""
        self._check_alive("get_comm_stream")
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """Not supported: EPX's workspace is laid out by the library, not a raw byte buffer for
        callers. The low-latency zero-copy input is get_next_low_latency_combine_buffer(handle)."""
        raise NotImplementedError("Buffer.get_local_buffer_tensor: EPX does not expose its workspace as a raw buffer "
                                  "(use get_next_low_latency_combine_buffer for the zero-copy combine input)")

    def destroy(self) -> None:
        """Release the EPX groups and handles (collective: every rank calls it). Needs
        explicitly_destroy=True, as DeepEP's. Every later call on this Buffer raises."""
        if not self.explicitly_destroy:
            raise RuntimeError("Buffer.destroy: the `explicitly_destroy` flag must be set (Buffer(..., "
                               "explicitly_destroy=True))")
        self._check_alive("destroy")
        self._destroyed = True
        states = [s for s in (self._normal, self._ll) if s is not None]
        self._normal = self._ll = None
        first = None
        for state in states:  # each group's collective destroy, whichever failed before
            try:
                state.destroy()
            except Exception as e:  # noqa: BLE001 (re-raised below, after the other group)
                first = first or e
        if first is not None:
            raise first

    # ------------------------------------------------------------------------------------------
    # Internals: liveness, groups
    # ------------------------------------------------------------------------------------------
    def _check_alive(self, fn: str) -> None:
        if getattr(self, "_destroyed", True):
            raise RuntimeError(f"Buffer.{fn}: the buffer has been destroyed")

    def _agree(self, fn: str, key: tuple, num_tokens: int) -> int:
        """Before a collective group creation: check that every rank asks for the same group and
        return the largest token count any rank passes (so that a too-small budget is refused on
        every rank alike instead of leaving the others in the group creation)."""
        items = [None] * self.group_size
        dist.all_gather_object(items, (key, int(num_tokens)), group=self.group)
        keys = sorted({repr(k) for k, _ in items})
        if len(keys) != 1:
            raise RuntimeError(f"Buffer.{fn}: the ranks create different EPX groups ({'; '.join(keys)}): every rank "
                               f"must make the same calls with the same shapes")
        return max(t for _, t in items)

    def _too_many_tokens(self, fn: str, num_tokens: int, state: _GroupState) -> str:
        return (f"Buffer.{fn}: {num_tokens} tokens on this rank: the EPX group serves at most {state.max_tokens} "
                f"per rank (the most that num_nvl_bytes = {self.num_nvl_bytes} holds at hidden {state.hidden}); "
                f"create the Buffer with more num_nvl_bytes")

    def _normal_state(self, fn: str, *, num_experts: int, num_tokens: int, hidden: Optional[int] = None,
                      top_k: Optional[int] = None) -> _GroupState:
        """The normal group for a call of these shapes (hidden None: layout; top_k None: routing
        by rank mask), created (collectively) when the current one does not serve them."""
        state = self._normal
        if state is not None and state.serves(num_experts, hidden, top_k):
            # More tokens than the group holds: never refused here, on this rank alone, while the
            # others go on into the dispatch. get_dispatch_layout computes such a layout in torch
            # and the dispatch goes on to EPX, which refuses it on every rank at once (this rank
            # tells its peers in the count exchange).
            return state
        if hidden is None and state is not None and not state.provisional:
            hidden = state.hidden
        if top_k is None:
            top_k = state.top_k if state is not None else 1
        if state is not None:
            self._normal = None
            state.destroy()
        self._normal = self._create_normal(fn, hidden, num_experts, top_k, num_tokens)
        return self._normal

    def _create_normal(self, fn: str, hidden: Optional[int], num_experts: int, top_k: int,
                       num_tokens: int) -> _GroupState:
        provisional = hidden is None
        if provisional:
            hidden = LAYOUT_ONLY_HIDDEN
        if self.num_nvl_bytes <= 0:
            raise ValueError(f"Buffer.{fn}: num_nvl_bytes = 0: normal-mode calls need EPX's normal-mode workspace; "
                             f"create the Buffer with num_nvl_bytes (Config.get_nvl_buffer_size_hint)")
        epx = core()
        key = ("normal", hidden, num_experts, top_k, self.num_nvl_bytes)
        need = self._agree(fn, key, num_tokens)
        num_ranks = self.group_size

        def size_of(m: int) -> int:
            return int(epx.workspace_size(num_ranks, m, hidden, num_experts, top_k, modes=("normal",))["total"])

        max_tokens = fit_max_tokens(size_of, self.num_nvl_bytes, need)
        if max_tokens is None:
            if need > EPX_MAX_TOKENS_PER_RANK:
                raise ValueError(f"Buffer.{fn}: {need} tokens on a rank: EPX takes at most {EPX_MAX_TOKENS_PER_RANK} "
                                 f"tokens per rank and call")
            raise ValueError(f"Buffer.{fn}: num_nvl_bytes = {self.num_nvl_bytes} is too small: {need} tokens per rank "
                             f"at hidden {hidden}, {num_experts} experts, top-{top_k} over {num_ranks} ranks need "
                             f"{size_of(need)} bytes of EPX normal-mode workspace")
        group = epx.Group(max_tokens, hidden, num_experts, top_k, group=self.group, modes=("normal",),
                          num_sms=Buffer.num_sms)
        return _GroupState(group, id(self), "normal", hidden, num_experts, top_k, max_tokens, provisional)

    def _ll_state(self, fn: str, hidden: int, num_experts: int, top_k: int, max_tokens: int) -> _GroupState:
        """The low-latency group for these shapes, (re)created collectively when they change."""
        state = self._ll
        if state is not None and (state.hidden, state.num_experts, state.top_k, state.max_tokens) == \
                (hidden, num_experts, top_k, max_tokens):
            return state
        if state is not None:
            self._ll = None
            state.destroy()
        epx = core()
        self._agree(fn, ("low_latency", hidden, num_experts, top_k, max_tokens, self.num_rdma_bytes), 0)
        need = int(epx.workspace_size(self.group_size, max_tokens, hidden, num_experts, top_k, modes=("low_latency",),
                                      ll_max_tokens_per_rank=max_tokens)["total"])
        if need > self.num_rdma_bytes:
            raise ValueError(f"Buffer.{fn}: num_rdma_bytes = {self.num_rdma_bytes} is too small for the low-latency "
                             f"workspace: {max_tokens} tokens per rank at hidden {hidden}, {num_experts} experts, "
                             f"top-{top_k} need {need} bytes (Buffer.get_low_latency_rdma_size_hint)")
        # DeepEP's outputs are the packed layout, which needs a by-rank dispatch route: name it,
        # so EPX_LL_ROUTE=direct in the environment cannot make every packed dispatch fail.
        group = epx.Group(max_tokens, hidden, num_experts, top_k, group=self.group, modes=("low_latency",),
                          ll_max_tokens_per_rank=max_tokens, ll_route="dispatch_by_rank")
        self._ll = _GroupState(group, id(self), "low_latency", hidden, num_experts, top_k, max_tokens)
        return self._ll

    def _dispatch_handle_parts(self, fn: str, handle):
        lease = getattr(handle, "_lease", None)
        if not isinstance(handle, DispatchHandle) or lease is None:
            raise TypeError(f"Buffer.{fn}: handle: expected the handle a dispatch of this Buffer returned, got "
                            f"{type(handle).__name__}")
        state = lease.state
        if state.owner_id != id(self) or not state.alive or state is not self._normal:
            raise RuntimeError(f"Buffer.{fn}: handle: its EPX group is gone (destroyed, or replaced by a call with "
                               f"other shapes) or belongs to another Buffer")
        return state, lease.handle

    @staticmethod
    def _fresh_copies(call: _CommCall, views: List[Tuple[Optional[torch.Tensor], int]]) -> List[Optional[torch.Tensor]]:
        """Fresh copies of view[:rows] for each (view, rows) (None stays None), allocated on the
        call's allocation stream and copied on the communication stream.

        These copies are the price of DeepEP's semantics (its outputs are new tensors that stay
        valid forever); epx.Group.dispatch gives the same data as zero-copy views of the
        workspace, valid until the next dispatch."""
        with stream_ctx(call.alloc_stream):
            outs = [None if v is None else torch.empty((rows,) + tuple(v.shape[1:]), dtype=v.dtype, device=v.device)
                    for v, rows in views]
        with stream_ctx(call.comm):
            for (view, rows), out in zip(views, outs):
                if out is not None and rows > 0:
                    out.copy_(view[:rows])
        call.tensors += [out for out in outs if out is not None]
        return outs

    # ------------------------------------------------------------------------------------------
    # Normal mode
    # ------------------------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False) -> \
            Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """``(num_tokens_per_rank [R] int32, None, num_tokens_per_expert [E] int32,
        is_token_in_rank [T, R] bool, event)`` of ``topk_idx`` [T, K] (-1 = no expert).

        The first call may create the normal EPX group (collective: every rank calls it)."""
        fn = "get_dispatch_layout"
        self._check_alive(fn)
        if topk_idx.dim() != 2:
            raise ValueError(f"Buffer.{fn}: topk_idx: expected [num_tokens, num_topk], got shape {tuple(topk_idx.shape)}")
        state = self._normal_state(fn, num_experts=int(num_experts), num_tokens=topk_idx.size(0),
                                   top_k=topk_idx.size(1))
        if topk_idx.size(0) > state.max_tokens:  # EPX's layout holds at most max_tokens (above)
            if previous_event is not None:
                previous_event.current_stream_wait()
            per_rank, per_expert, in_rank = _layout_in_torch(topk_idx, int(num_experts), self.group_size)
            return per_rank, None, per_expert, in_rank, EventOverlap(EventHandle() if async_finish else None)
        if previous_event is None and not async_finish and not allocate_on_comm_stream:
            # Same effect as DeepEP's detour through the communication stream (which waits for the
            # current stream and is waited for), without the two cross-stream waits: the layout
            # writes only its own fresh outputs.
            layout = state.group.layout(topk_idx)
            return (layout.num_tokens_per_rank, None, layout.num_tokens_per_expert, layout.is_token_in_rank,
                    EventOverlap(None))
        call = _CommCall(fn, self._comm_stream, previous_event, async_finish, allocate_on_comm_stream)
        with stream_ctx(call.alloc_stream):
            layout = state.group.layout(topk_idx, stream=call.comm)
        # Every output is written on the communication stream, token_pos_in_rank too (not returned: dropped when
        # this call returns, so it must be recorded as well, or the caching allocator could hand its memory to the
        # current stream while the layout kernel still writes it).
        call.tensors += [topk_idx, layout.num_tokens_per_rank, layout.num_tokens_per_expert, layout.is_token_in_rank,
                         layout.token_pos_in_rank]
        return (layout.num_tokens_per_rank, None, layout.num_tokens_per_expert, layout.is_token_in_rank,
                call.finish())

    def dispatch(self, x: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], Optional[torch.Tensor],
                  Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        """Send each token to the ranks of its experts. Returns ``(recv_x (a tensor, or
        (recv_x_fp8, recv_x_scales) for an FP8 tuple), recv_topk_idx [N, K] int64 (local expert
        ids, -1 elsewhere), recv_topk_weights [N, K] float32, num_recv_tokens_per_expert_list,
        handle, event)``; rows in source-rank then source-token order.

        * With ``topk_idx``: routed by expert ids (the layout arguments are not needed).
          Without: routed by ``is_token_in_rank`` [T, R] with ``num_tokens_per_expert`` [E];
          recv_topk_idx / recv_topk_weights are None then.
        * ``x`` may be ``(x_fp8 [T, H] float8_e4m3fn, scales)``: scales [T, H/128] float32 with any
          strides (e.g. column-major), or [T, ceil(H/512)] int32 packed UE8M0.
        * ``num_worst_tokens > 0``: no host synchronization; the outputs have that many rows
          (recv_topk_idx -1 past the real count) and the per-expert list is empty.
        * ``handle`` given: cached dispatch with that routing; returns ``(recv_x, None, None,
          None, None, event)``.
        * ``config`` and ``num_tokens_per_rdma_rank`` are ignored; ``num_tokens_per_rank`` too (EPX
          counts itself)."""
        fn = "dispatch"
        self._check_alive(fn)
        x, x_scales = _split_x(x)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError(f"Buffer.{fn}: a cached dispatch (handle given) takes no topk_idx / topk_weights")
            return self._cached_dispatch(x, x_scales, handle, previous_event, async_finish, allocate_on_comm_stream)
        if x.dim() != 2:
            raise ValueError(f"Buffer.{fn}: x: expected [num_tokens, hidden], got shape {tuple(x.shape)}")
        num_tokens, hidden = x.size(0), x.size(1)
        num_worst_tokens = int(num_worst_tokens)
        if num_worst_tokens < 0:
            raise ValueError(f"Buffer.{fn}: num_worst_tokens = {num_worst_tokens}: must be >= 0")
        by_ids = topk_idx is not None
        if by_ids:
            if topk_idx.dim() != 2 or topk_idx.size(0) != num_tokens:
                raise ValueError(f"Buffer.{fn}: topk_idx: expected [{num_tokens}, num_topk], got {tuple(topk_idx.shape)}")
            if num_tokens_per_expert is not None:
                num_experts = num_tokens_per_expert.numel()
            elif self._normal is not None:
                num_experts = self._normal.num_experts
            else:
                raise ValueError(f"Buffer.{fn}: num_tokens_per_expert is needed (its length is the expert count)")
            top_k = topk_idx.size(1)
        else:
            if topk_weights is not None:
                raise ValueError(f"Buffer.{fn}: topk_weights without topk_idx")
            if is_token_in_rank is None or num_tokens_per_expert is None:
                raise ValueError(f"Buffer.{fn}: without topk_idx, is_token_in_rank and num_tokens_per_expert are needed")
            num_experts, top_k = num_tokens_per_expert.numel(), None
        state = self._normal_state(fn, num_experts=num_experts, num_tokens=num_tokens, hidden=hidden, top_k=top_k)

        call = _CommCall(fn, self._comm_stream, previous_event, async_finish, allocate_on_comm_stream)
        epx_handle = state.take_handle()
        try:
            result = state.group.dispatch(
                epx_handle, x, topk_idx, topk_weights, x_scales=x_scales,
                is_token_in_rank=None if by_ids else is_token_in_rank,
                num_tokens_per_expert=None if by_ids else num_tokens_per_expert,
                expert_alignment=expert_alignment, sync_counts=num_worst_tokens == 0,
                num_worst_tokens=num_worst_tokens, recv_topk_idx_dtype=torch.int64, stream=call.comm)
            lease = _Lease(state, epx_handle)
        except EpxInvalidArgument as e:
            state.give_back(epx_handle)
            if num_tokens > state.max_tokens:  # refused by EPX on every rank (the others: EpxTimeout)
                raise ValueError(self._too_many_tokens(fn, num_tokens, state)) from e
            raise
        except BaseException:
            state.give_back(epx_handle)
            raise
        rows = num_worst_tokens if num_worst_tokens > 0 else int(result.num_recv)
        if rows < 0:
            raise RuntimeError(f"Buffer.{fn}: EPX returned no receive count (num_recv = {result.num_recv})")
        counts = [] if num_worst_tokens > 0 else [int(c) for c in result.num_recv_per_expert]
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx, rank_prefix_matrix = self._fresh_copies(
            call, [(result.recv_x, rows),
                   (_recv_scales(result) if x_scales is not None else None, rows),
                   (result.recv_topk_idx if by_ids else None, rows),
                   (result.recv_topk_weights if by_ids and topk_weights is not None else None, rows),
                   (result.recv_src_token, rows),
                   (result.rank_prefix_matrix, self.group_size)])

        call.tensors += [x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                         num_tokens_per_rank]
        new_handle = DispatchHandle(rank_prefix_matrix, recv_src_idx, is_token_in_rank, lease=lease, num_recv=rows,
                                    num_tokens=num_tokens, num_worst_tokens=num_worst_tokens)
        event = call.finish()
        recv = (recv_x, recv_scales) if x_scales is not None else recv_x
        return recv, recv_topk_idx, recv_topk_weights, counts, new_handle, event

    def _cached_dispatch(self, x, x_scales, handle, previous_event, async_finish, allocate_on_comm_stream):
        fn = "dispatch"
        state, epx_handle = self._dispatch_handle_parts(fn, handle)
        call = _CommCall(fn, self._comm_stream, previous_event, async_finish, allocate_on_comm_stream)
        result = state.group.dispatch_cached(epx_handle, x, x_scales=x_scales, stream=call.comm)
        rows = handle.num_recv
        recv_x, recv_scales = self._fresh_copies(
            call, [(result.recv_x, rows), (_recv_scales(result) if x_scales is not None else None, rows)])
        recv = (recv_x, recv_scales) if x_scales is not None else recv_x
        call.tensors += [x, x_scales]
        return recv, None, None, None, None, call.finish()

    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Return each received row to its token and sum them (no weights), plus ``bias`` (a
        tensor or a pair). ``topk_weights`` [N, K] float32 (the received rows' weights) come back
        summed per token as ``combined_topk_weights`` [T, K]. Returns ``(combined_x [T, H] bf16,
        combined_topk_weights or None, event)``. ``config`` is ignored."""
        fn = "combine"
        self._check_alive(fn)
        state, epx_handle = self._dispatch_handle_parts(fn, handle)
        bias = _bias_arg(bias)
        call = _CommCall(fn, self._comm_stream, previous_event, async_finish, allocate_on_comm_stream)
        with stream_ctx(call.alloc_stream):
            combined_x, combined_topk_weights = state.group.combine(epx_handle, x, recv_topk_weights=topk_weights,
                                                                    bias=bias, stream=call.comm)
        call.tensors += [x, topk_weights, combined_x, combined_topk_weights]
        call.tensors += list(bias) if isinstance(bias, tuple) else [bias]
        return combined_x, combined_topk_weights, call.finish()

    def internode_dispatch(self, *args, **kwargs):
        """Not supported: EPX has no internode (RDMA) transport."""
        raise NotImplementedError("Buffer.internode_dispatch: internode (RDMA) dispatch is not supported by EPX "
                                  "(one host, NVLink only)")

    def internode_combine(self, *args, **kwargs):
        """Not supported: EPX has no internode (RDMA) transport."""
        raise NotImplementedError("Buffer.internode_combine: internode (RDMA) combine is not supported by EPX "
                                  "(one host, NVLink only)")

    # ------------------------------------------------------------------------------------------
    # Low-latency mode
    # ------------------------------------------------------------------------------------------
    def _require_ll(self, fn: str) -> None:
        if not self.low_latency_mode:
            raise RuntimeError(f"Buffer.{fn}: the Buffer was created with low_latency_mode=False")

    def _ll_parts(self, fn: str, handle):
        state = getattr(handle, "_state", None)
        if not isinstance(handle, LowLatencyHandle) or state is None:
            raise TypeError(f"Buffer.{fn}: handle: expected the handle a low_latency_dispatch of this Buffer "
                            f"returned, got {type(handle).__name__}")
        if state.owner_id != id(self) or not state.alive or state is not self._ll:
            raise RuntimeError(f"Buffer.{fn}: handle: its EPX low-latency group is gone (destroyed, or replaced "
                               f"by a call with other shapes) or belongs to another Buffer")
        return state, handle.epx_result

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """EPX needs no cleaning (every signal carries a call epoch; nothing is zeroed between
        calls, even after normal-mode calls). Kept as a collective: a barrier of the low-latency
        group on the current stream, if it exists; in shrink mode over the ranks this rank has
        not masked (a masked, dead rank is not waited for, as DeepEP's clean skips it). The peer
        mask is left as it is (DeepEP's clean keeps masked ranks masked;
        low_latency_clean_mask_buffer clears it)."""
        fn = "clean_low_latency_buffer"
        self._check_alive(fn)
        self._require_ll(fn)
        if self._ll is not None:
            self._ll.group.barrier(skip_masked=self.enable_shrink)

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, use_nvfp4: bool = False,
                             x_global_scale: Optional[torch.Tensor] = None) -> \
            Tuple[Union[Tuple[torch.Tensor, torch.Tensor], torch.Tensor], torch.Tensor, Tuple, EventOverlap,
                  Optional[Callable]]:
        """Send each token to its experts, into DeepEP's packed layout. Returns ``(recv_x,
        recv_count [L] int32, handle, event, hook)``:

        * recv_x: [L, R*M, H] bf16, or with ``use_fp8`` ``(fp8 [L, R*M, H], scales)``: scales
          [L, R*M, H/128] float32 (powers of two with ``round_scale``), or with ``use_ue8m0``
          [L, R*M, H/512] int32 packed exponents. Rows [0, recv_count[j]) of expert j are valid.
          The scales are row-major (DeepEP's are a column-major view of the same shape; call
          ``.contiguous()`` as its tests do, or read them as they are).
        * Outputs are views of EPX's workspace, valid until the dispatch after next (two buffers
          alternate), as DeepEP documents for its own.
        * ``return_recv_hook``: only the send is issued; ``hook()`` completes the receive (on the
          stream of this call) before the outputs are used. ``async_finish``: an event on the
          current stream (the call runs on the current stream).
        * ``cumulative_local_expert_recv_stats`` [L] int32 is increased by recv_count once the
          receive is done; ``dispatch_wait_recv_cost_stats`` is accepted and left untouched."""
        fn = "low_latency_dispatch"
        if use_nvfp4 or x_global_scale is not None:
            raise NotImplementedError(f"Buffer.{fn}: NVFP4 dispatch (use_nvfp4 / x_global_scale) is not supported by "
                                      f"EPX (BF16 or FP8 E4M3)")
        if use_ue8m0 and not round_scale:
            raise ValueError(f"Buffer.{fn}: use_ue8m0=True needs round_scale=True")
        if async_finish and return_recv_hook:
            raise ValueError(f"Buffer.{fn}: async_finish and return_recv_hook cannot both be set")
        self._check_alive(fn)
        self._require_ll(fn)
        if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.size(0) != x.size(0):
            raise ValueError(f"Buffer.{fn}: expected x [T, hidden] and topk_idx [T, num_topk], got "
                             f"{tuple(x.shape)} and {tuple(topk_idx.shape)}")
        max_tokens = int(num_max_dispatch_tokens_per_rank)
        num_tokens, hidden = x.size(0), x.size(1)
        if num_tokens > max_tokens:
            raise ValueError(f"Buffer.{fn}: {num_tokens} tokens: more than num_max_dispatch_tokens_per_rank = "
                             f"{max_tokens}")
        stats = cumulative_local_expert_recv_stats
        num_local_experts = int(num_experts) // self.group_size
        if stats is not None and (stats.dtype != torch.int32 or stats.numel() != num_local_experts):
            raise ValueError(f"Buffer.{fn}: cumulative_local_expert_recv_stats: expected [{num_local_experts}] int32, "
                             f"got {tuple(stats.shape)} {stats.dtype}")
        state = self._ll_state(fn, hidden, int(num_experts), topk_idx.size(1), max_tokens)
        fp8 = bool(use_fp8)
        group = state.group
        stream = current_stream() if (return_recv_hook or async_finish) else None
        result = group.ll_dispatch(x, topk_idx, fp8=fp8, ue8m0=fp8 and bool(round_scale),
                                   ue8m0_packed=fp8 and bool(use_ue8m0), packed=True, split=bool(return_recv_hook),
                                   layout_range=True)
        if fp8:
            scales = result.recv_x_scales_packed if use_ue8m0 else result.recv_x_scales
            recv = (result.recv_x, scales)
        else:
            scales, recv = None, result.recv_x
        recv_count = result.recv_count
        handle = LowLatencyHandle(state.source_tokens(result.recv_src_info), result.layout_range, max_tokens, hidden,
                                  int(num_experts), result=result, state=state)
        hook = None
        if return_recv_hook:
            def receive() -> None:
                with stream_ctx(stream):
                    group.ll_recv(result.hook)
                    if stats is not None:
                        stats.add_(recv_count)

            hook = receive
        elif stats is not None:
            stats.add_(recv_count)
        event = EventOverlap(None)
        if async_finish:
            event = EventOverlap(EventHandle(stream), (x, topk_idx, result.recv_x, scales, recv_count, handle[0],
                                                       handle[1], stats))
        return recv, recv_count, handle, event, hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None) -> \
            Tuple[torch.Tensor, EventOverlap, Optional[Callable]]:
        """Return every row of the dispatch to its token and reduce with ``topk_weights`` [T, K]
        float32. Returns ``(combined_x [T, H] bf16 (``out`` if given), event, hook)``.

        ``x`` is [L, R*M, H] bf16 (rows as the dispatch delivered them); ``zero_copy=True`` reads
        get_next_low_latency_combine_buffer(handle) instead. ``topk_idx`` must be the dispatch's:
        EPX kept them, so the argument is not read. ``return_recv_hook`` / ``async_finish`` as for
        the dispatch; ``combine_wait_recv_cost_stats`` is accepted and left untouched."""
        fn = "low_latency_combine"
        if use_logfmt:
            raise NotImplementedError(f"Buffer.{fn}: use_logfmt=True: the LogFMT combine format is not supported by "
                                      f"EPX (BF16 rows, float32 sums)")
        if async_finish and return_recv_hook:
            raise ValueError(f"Buffer.{fn}: async_finish and return_recv_hook cannot both be set")
        self._check_alive(fn)
        self._require_ll(fn)
        state, result = self._ll_parts(fn, handle)
        group = state.group
        stream = current_stream() if (return_recv_hook or async_finish) else None
        res = group.ll_combine(result, x=None if zero_copy else x, out=out, topk_weights=topk_weights,
                               split=bool(return_recv_hook))
        hook = None
        if return_recv_hook:
            combined_x, epx_hook = res

            def receive() -> None:
                with stream_ctx(stream):
                    group.ll_recv(epx_hook)

            # Read (weights) or written (output) by the receive half: the hook keeps them alive.
            receive.tensors = (topk_weights, combined_x)
            hook = receive
        else:
            combined_x = res
        event = EventOverlap(None)
        if async_finish:
            event = EventOverlap(EventHandle(stream), (x, topk_idx, topk_weights, handle[0], handle[1], combined_x))
        return combined_x, event, hook

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """The zero-copy combine input of this dispatch: [L, R*M, H] bf16 in EPX's workspace.
        Write the expert outputs there and call low_latency_combine(..., zero_copy=True)."""
        fn = "get_next_low_latency_combine_buffer"
        self._check_alive(fn)
        _, result = self._ll_parts(fn, handle)
        return result.combine_input

    # ------------------------------------------------------------------------------------------
    # Peer masking (DeepEP's shrink mode)
    # ------------------------------------------------------------------------------------------
    def _require_shrink(self, fn: str) -> None:
        self._check_alive(fn)
        if not self.enable_shrink:
            raise RuntimeError(f"Buffer.{fn}: shrink mode must be enabled (Buffer(..., enable_shrink=True))")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """mask=True: stop sending to and waiting for ``rank_to_mask`` in later low-latency calls
        of this rank (stream-ordered). mask=False: a no-op if the rank is not masked; EPX cannot
        unmask one rank alone (NotImplementedError): low_latency_clean_mask_buffer() unmasks all."""
        fn = "low_latency_update_mask_buffer"
        self._require_shrink(fn)
        if not 0 <= int(rank_to_mask) < self.group_size:
            raise ValueError(f"Buffer.{fn}: rank {rank_to_mask} is not in 0..{self.group_size - 1}")
        if self._ll is None:
            if not mask:
                return
            raise RuntimeError(f"Buffer.{fn}: no low-latency EPX group yet (it is created by the first "
                               f"low_latency_dispatch)")
        if mask:
            self._ll.group.mask_peer(int(rank_to_mask))
            return
        current_stream().synchronize()
        if (int(self._ll.group.peer_mask) >> int(rank_to_mask)) & 1:
            raise NotImplementedError(f"Buffer.{fn}: EPX cannot unmask one rank: call low_latency_clean_mask_buffer() "
                                      f"on every rank to unmask all of them")

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Fill ``mask_status`` [R] int32 with 1 for every masked rank, 0 otherwise (after the
        work queued on the current stream: the call synchronizes it)."""
        fn = "low_latency_query_mask_buffer"
        self._require_shrink(fn)
        if mask_status.numel() != self.group_size or mask_status.dtype != torch.int32:
            raise ValueError(f"Buffer.{fn}: mask_status: expected [{self.group_size}] int32, got "
                             f"{tuple(mask_status.shape)} {mask_status.dtype}")
        bits = 0
        if self._ll is not None:
            current_stream().synchronize()
            bits = int(self._ll.group.peer_mask)
        values = torch.tensor([(bits >> r) & 1 for r in range(self.group_size)], dtype=torch.int32)
        mask_status.copy_(values.view(mask_status.shape))

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank (collective: every rank calls it, the recovered ones included)."""
        fn = "low_latency_clean_mask_buffer"
        self._require_shrink(fn)
        if self._ll is not None:
            self._ll.group.clear_peer_mask()
