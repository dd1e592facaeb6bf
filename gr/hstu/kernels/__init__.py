"""One jagged HSTU attention API over several backends.

``pytorch`` is the reference and runs on any device; fast backends are checked
against it by the conformance tests.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

from torch import Tensor

from gr.hstu.kernels.common import RelativeBias
from gr.hstu.kernels.pytorch import pytorch_hstu_attention

__all__ = ["RelativeBias", "hstu_attention", "available_backends", "resolve_backend"]

_BACKENDS: Dict[str, Callable[..., Tensor]] = {"pytorch": pytorch_hstu_attention}


def available_backends() -> list:
    return sorted(_BACKENDS)


def resolve_backend(backend: str, device_type: str) -> str:
    """Map "auto" to a backend for tensors on ``device_type``."""
    if backend != "auto":
        return backend
    return "pytorch"


def hstu_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    max_seq_len: int,
    *,
    num_targets: Optional[Tensor] = None,
    contextual_len: int = 0,
    max_attn_len: int = 0,
    alpha: float = 1.0,
    silu_scale: Optional[float] = None,
    rab: Optional[RelativeBias] = None,
    backend: str = "auto",
) -> Tensor:
    """Jagged HSTU attention: ``out_i = sum_j mask_ij * SiLU(alpha q_i.k_j + rab_ij) * norm_i * v_j``.

    q: [T, H, Dqk] float
    k: [T, H, Dqk] float
    v: [T, H, Dv] float
    seq_offsets: [B+1] int64
    max_seq_len: int, >= the longest sequence in the batch (targets included)
    num_targets: [B] int64 or None: trailing candidate tokens per sequence
    contextual_len: leading tokens visible to every token
    max_attn_len: look-back window in positions, 0 = unbounded
    silu_scale: norm_i; None -> 1 / (pos_i + 1) (per-sequence length so far)
    rab: relative bias parts (``RelativeBias``) or None
    returns: [T, H, Dv]
    """
    name = resolve_backend(backend, q.device.type)
    if name not in _BACKENDS:
        raise ValueError(f"hstu_attention: unknown backend {name!r}; available: {available_backends()}")
    return _BACKENDS[name](
        q, k, v, seq_offsets, max_seq_len, num_targets, contextual_len, max_attn_len, alpha, silu_scale, rab
    )
