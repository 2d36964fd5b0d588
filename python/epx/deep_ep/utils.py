"""Events, streams and small helpers of ``epx.deep_ep`` (DeepEP V1's ``deep_ep.utils`` surface).

``EventHandle`` and ``EventOverlap`` behave as DeepEP's: an ``EventHandle`` is a CUDA event
recorded when it is made (on the current stream, or on the stream given), and an
``EventOverlap`` wraps one (or none) plus tensors whose lifetime must reach the event.

The stream helpers are the only places where this package asks torch for streams, so that the
CPU tests can stand in for them.
"""

from typing import Any, Optional, Tuple

import torch

# Compiled limits of the EPX library (include/epx.h); repeated here so that argument checks and
# size hints need no library call.
EPX_MAX_RANKS = 8
EPX_MAX_TOP_K = 16
EPX_MAX_EXPERTS = 1024
EPX_MAX_TOKENS_PER_RANK = 65536


def core():
    """The EPX core package (``epx``: ``Group``, ``workspace_size``, ``errors``).

    Imported when first needed, not when ``epx.deep_ep`` is imported: the parent package may
    import this one, and the pure-Python parts (Config, events, argument checks) work without
    the native library.
    """
    import epx as _epx  # the parent package

    if not hasattr(_epx, "Group") or not hasattr(_epx, "workspace_size"):
        raise ImportError(
            "epx.deep_ep needs the EPX core package (epx.Group, epx.workspace_size), which is not "
            "importable here: install the epx package (pip install .) or build libepx")
    return _epx


def current_stream():
    """torch's current CUDA stream."""
    return torch.cuda.current_stream()


def new_stream():
    """A new CUDA stream on the current device (the Buffer's communication stream)."""
    return torch.cuda.Stream()


def stream_ctx(stream):
    """Context manager making ``stream`` torch's current stream."""
    return torch.cuda.stream(stream)


def record_stream(tensor: torch.Tensor, stream) -> None:
    """Tell torch's caching allocator that ``tensor`` is used on ``stream`` (so that its memory is
    not reused before the work queued there so far has run)."""
    tensor.record_stream(stream)


class EventHandle:
    """A CUDA event, recorded at creation on ``stream`` (default: the current stream).

    DeepEP's ``EventHandle()`` records on the current stream; the optional ``stream`` argument is
    this package's addition.
    """

    def __init__(self, stream: Optional[Any] = None) -> None:
        self.event = torch.cuda.Event()
        self.event.record(current_stream() if stream is None else stream)

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event."""
        current_stream().wait_event(self.event)


def as_cuda_event(obj: Any):
    """The torch CUDA event behind ``obj`` (an EventOverlap, an EventHandle or a torch event);
    None when there is none (``obj`` None, or an EventOverlap without event)."""
    if obj is None:
        return None
    if isinstance(obj, EventOverlap):
        return as_cuda_event(obj.event)
    if isinstance(obj, EventHandle):
        return obj.event
    if isinstance(obj, torch.cuda.Event):
        return obj
    inner = getattr(obj, "event", None)
    if inner is not None and inner is not obj:
        return as_cuda_event(inner)
    raise TypeError(f"previous_event: expected an EventOverlap or EventHandle, got {type(obj).__name__}")


class EventOverlap:
    """A CUDA event (or none) and the tensors that must live until it completes.

    Attributes:
        event: the ``EventHandle``, or None (the operation was not asynchronous).
        extra_tensors: tensors kept alive with the event (DeepEP's substitute for
            ``record_stream``, which CUDA graphs do not allow).

    ``with overlap: ...`` runs the body, then makes the current stream wait for the event (if
    any); ``current_stream_wait()`` does the wait alone.
    """

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Tuple[torch.Tensor, ...]] = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """The current stream waits for the event. Raises RuntimeError when there is none."""
        if self.event is None:
            raise RuntimeError("EventOverlap.current_stream_wait: no event (the call that made it "
                               "was not asynchronous: pass async_finish=True)")
        self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> None:
        if self.event is not None:
            self.event.current_stream_wait()
