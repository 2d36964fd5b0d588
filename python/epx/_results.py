"""What Group calls return: Layout (fresh tensors), DispatchResult (views of the workspace and
the handle), LLDispatchResult (views of the low-latency workspace, with the C result that
ll_combine reads) and Hook (the receive half of a split low-latency call).

Plain containers: they hold tensors and keep alive what C still reads; the calls that fill
them are in group.py.
"""
import typing


class Layout(typing.NamedTuple):
    num_tokens_per_rank: typing.Any  # [R] int32
    num_tokens_per_expert: typing.Any  # [E] int32
    is_token_in_rank: typing.Any  # [T, R] bool
    token_pos_in_rank: typing.Any  # [T, R] int32


class DispatchResult(typing.NamedTuple):
    """Views of the workspace and the handle, valid until the next dispatch on the group."""
    num_recv: int  # rows received; -1 when unknown on the host
    recv_x: typing.Any  # [n, H] bf16 or float8_e4m3fn
    recv_x_scales: typing.Any  # [n, H/128] f32, [n, ceil(H/512)] i32 (packed UE8M0), or None
    recv_topk_idx: typing.Any  # [n, K] int32 or int64, local expert ids, -1 elsewhere
    recv_topk_weights: typing.Any  # [n, K] f32
    recv_src_token: typing.Any  # [n] i32
    recv_rank_prefix: typing.Any  # [R + 1] i32
    num_recv_device: typing.Any  # [1] i32
    num_recv_per_expert: typing.Optional[list]  # host counts (sync_counts) or None
    num_recv_per_expert_device: typing.Any  # [E/R] i32
    rank_prefix_matrix: typing.Any  # [R, R] i32
    capacity: int  # rows the receive arrays hold (n when the count is unknown)


class ExpandResult(typing.NamedTuple):
    """An expert-major dispatch (Group.dispatch_expand): views of the workspace and the handle,
    valid until the next dispatch on the group. Local expert j's rows are
    [expert_begin[j], expert_begin[j] + expert_count[j]); the rest of its segment is padding
    (src_info -1, weight 0)."""
    num_rows: int  # rows, padding included (begin[L]); -1 when unknown on the host
    num_recv: int  # tokens received (one per (source, token)); -1 when unknown on the host
    recv_x: typing.Any  # [n, H] bf16 or float8_e4m3fn, n = num_rows, or capacity when unknown
    recv_x_scales: typing.Any  # [n, H/128] f32, [n, ceil(H/512)] i32 (packed UE8M0), or None
    recv_src_info: typing.Any  # [n, 4] i32: source rank, source token, first slot, 0
    recv_weights: typing.Any  # [n] f32
    expert_begin: typing.Any  # device [L + 1] i32
    expert_count: typing.Any  # device [L] i32
    num_rows_device: typing.Any  # device [1] i32
    token_rows: typing.Any  # [num_recv or R*M, K] i32: each received token's rows, then -1
    recv_rank_prefix: typing.Any  # [R + 1] i32: source s's tokens in token_rows
    num_recv_device: typing.Any  # [1] i32
    num_recv_per_expert: typing.Optional[list]  # host expert_count (sync_counts) or None
    capacity: int  # config expand_max_rows
    # [L] i32 (C's uint32): 1 once local expert j's real rows are complete, before the dispatch
    # ends (epx.h's expert_ready, its whole contract). With sync_counts, work queued on any
    # stream after the call may wait on it; without, only work ordered after the call's count
    # exchange: counts_event below, a raw cudaEvent_t (torch cannot wrap it; the C API can).
    expert_ready: typing.Any = None
    counts_event: int = 0


class LLDispatchResult:
    """A low-latency dispatch: views valid until the dispatch after next. Keeps the C result
    (._c) for ll_combine, and its group alive."""

    _FIELDS = ("recv_x", "recv_x_scales", "recv_x_scales_packed", "recv_src_info", "recv_count",
               "recv_begin", "recv_num", "combine_input", "layout_range", "num_tokens", "buffer",
               "packed", "hook")

    def __init__(self, group, c_result, keep, **fields):
        self._group = group
        self._c = c_result
        self._keep = keep  # tensors C reads or writes later (layout_range, inputs)
        for name in self._FIELDS:
            setattr(self, name, fields[name])

    def __repr__(self):
        return "LLDispatchResult(num_tokens=%d, buffer=%d, packed=%s, recv_x=%s, split=%s)" % (
            self.num_tokens, self.buffer, self.packed, tuple(self.recv_x.shape),
            self.hook is not None)


class Hook:
    """The receive half of a split low-latency call: hook() (or Group.ll_recv(hook)) queues it
    on the current stream. Calling it twice raises EpxInvalidUsage (nothing is pending)."""

    def __init__(self, group, c_hook, keep=()):
        self._group = group
        self._c = c_hook  # epx_ll_hook_t (inside an LL dispatch result, or its own)
        self._keep = keep  # what C reads or writes when the receive runs (out, weights)

    @property
    def pending(self):
        return self._c.id != 0

    def __call__(self, stream=None):
        self._group.ll_recv(self, stream=stream)

    def __repr__(self):
        return "Hook(id=%d, pending=%s)" % (self._c.id, self.pending)

