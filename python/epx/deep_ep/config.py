"""``Config``: DeepEP V1's performance config, accepted for compatibility.

EPX does not use chunked queues: its normal-mode dispatch writes every token straight into its
final row of the receiver's slab, and its combine pipelines by 64-row chunks of its own. So the
chunk sizes of a Config are accepted, kept and ignored; ``num_sms`` too (EPX's SM budget is the
group's, fixed at creation from ``Buffer.num_sms``). What a Config still does is answer the
buffer-size questions frameworks ask before they create a Buffer, in EPX's terms.
"""

import operator

from .utils import EPX_MAX_EXPERTS, EPX_MAX_RANKS, EPX_MAX_TOP_K, core

# Tokens per rank that Config.get_nvl_buffer_size_hint sizes EPX's normal-mode workspace for.
# DeepEP's hint depends only on the chunk sizes; EPX's workspace grows with the largest token
# count per rank (its receive slab holds R x max_tokens rows), which a hint is not told. A Buffer
# sizes its group to the largest count that fits num_nvl_bytes, so pass more bytes for more
# tokens (epx.workspace_size says how many).
NVL_HINT_TOKENS_PER_RANK = 4096


def _align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _check_ranks(fn: str, num_ranks: int) -> int:
    num_ranks = int(num_ranks)
    if num_ranks < 1:
        raise ValueError(f"{fn}: num_ranks = {num_ranks}: must be positive")
    return num_ranks


class Config:
    """DeepEP's ``Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)``.

    The fields are kept (and checked as DeepEP checks the NVLink ones) but EPX ignores all of
    them: see the module docstring.
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        values = dict(num_sms=num_sms, num_max_nvl_chunked_send_tokens=num_max_nvl_chunked_send_tokens,
                      num_max_nvl_chunked_recv_tokens=num_max_nvl_chunked_recv_tokens,
                      num_max_rdma_chunked_send_tokens=num_max_rdma_chunked_send_tokens,
                      num_max_rdma_chunked_recv_tokens=num_max_rdma_chunked_recv_tokens)
        for name, value in values.items():
            if isinstance(value, bool):
                raise TypeError(f"Config: {name} = {value!r}: expected an int")
            try:
                values[name] = operator.index(value)
            except TypeError:
                raise TypeError(f"Config: {name} = {value!r}: expected an int") from None
        num_sms = values["num_sms"]
        num_max_nvl_chunked_send_tokens = values["num_max_nvl_chunked_send_tokens"]
        num_max_nvl_chunked_recv_tokens = values["num_max_nvl_chunked_recv_tokens"]
        num_max_rdma_chunked_send_tokens = values["num_max_rdma_chunked_send_tokens"]
        num_max_rdma_chunked_recv_tokens = values["num_max_rdma_chunked_recv_tokens"]
        if num_sms < 0:
            raise ValueError(f"Config: num_sms = {num_sms}: must be >= 0")
        for name, value in values.items():
            if name != "num_sms" and value <= 0:
                raise ValueError(f"Config: {name} = {value}: must be positive")
        if num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens:
            raise ValueError(f"Config: num_max_nvl_chunked_send_tokens = {num_max_nvl_chunked_send_tokens} must be "
                             f"below num_max_nvl_chunked_recv_tokens = {num_max_nvl_chunked_recv_tokens}")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of EPX's normal-mode workspace (per GPU) for NVL_HINT_TOKENS_PER_RANK tokens per
        rank of ``hidden_bytes`` bytes (BF16: hidden = hidden_bytes / 2), at the largest top-k and
        expert count EPX supports, so a Buffer given this many bytes serves at least that many
        tokens per rank for any routing. Needs the EPX library, not a GPU.

        Raises NotImplementedError above 8 ranks (one host)."""
        num_ranks = _check_ranks("Config.get_nvl_buffer_size_hint", num_ranks)
        hidden_bytes = int(hidden_bytes)
        if hidden_bytes <= 0:
            raise ValueError(f"Config.get_nvl_buffer_size_hint: hidden_bytes = {hidden_bytes}: must be positive")
        if num_ranks > EPX_MAX_RANKS:
            raise NotImplementedError(f"Config.get_nvl_buffer_size_hint: num_ranks = {num_ranks}: EPX groups span "
                                      f"one host of at most {EPX_MAX_RANKS} GPUs (no internode RDMA)")
        # BF16 elements, rounded up to whole FP8 scale groups so that FP8 payloads fit too.
        hidden = _align_up((hidden_bytes + 1) // 2, 128)
        ranks = max(num_ranks, 2)  # a 1-rank group does not exist in EPX; size as 2
        experts = ranks * (EPX_MAX_EXPERTS // ranks)
        sizes = core().workspace_size(ranks, NVL_HINT_TOKENS_PER_RANK, hidden, experts,
                                      min(EPX_MAX_TOP_K, experts), modes=("normal",))
        return int(sizes["total"])

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0 on one host (EPX has no RDMA buffer, as DeepEP's intranode mode). Above 8 ranks
        (more than one host) raises NotImplementedError: EPX has no internode transport."""
        num_ranks = _check_ranks("Config.get_rdma_buffer_size_hint", num_ranks)
        if num_ranks > EPX_MAX_RANKS:
            raise NotImplementedError(f"Config.get_rdma_buffer_size_hint: num_ranks = {num_ranks}: internode (RDMA) "
                                      f"communication is not supported by EPX (one host, at most {EPX_MAX_RANKS} GPUs)")
        return 0
