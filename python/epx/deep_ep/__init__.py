"""DeepEP V1's Python surface (``deep_ep``) on EPX: ``from epx import deep_ep``.

A drop-in for code written against DeepEP V1's ``deep_ep`` module (its tests, SGLang, vLLM,
Megatron-LM): ``Buffer`` (normal and low-latency dispatch/combine on one host), ``Config``,
``EventOverlap``, ``EventHandle`` and ``topk_idx_t``. See ``epx.deep_ep.buffer`` for what maps to
what, what is ignored and what is refused; ``epx.Group`` is the native (zero-copy) API.
"""

import torch

from .buffer import Buffer
from .config import Config
from .utils import EventHandle, EventOverlap

# The dtype of expert ids (DeepEP's topk_idx_t): received ids come back in it.
topk_idx_t = torch.int64

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t"]
