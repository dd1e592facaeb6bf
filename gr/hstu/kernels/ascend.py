"""The Ascend NPU backend: Huawei RecSDK's ``torch.ops.mxrec.hstu_jagged`` when its op library
is loaded, else the triton-ascend kernels (``ascend_triton``).

Nothing NPU-specific is imported here: tensors on an ``npu`` device mean torch_npu is already
loaded, and the vendor op is looked up in ``torch.ops`` only when this backend is called.

Mapping to ``hstu_jagged(q, k, v, mask, attn_bias, mask_type, max_seq_len, silu_scale,
seq_offset, num_context, num_target, target_group_size, alpha)`` (RecSDK computes
``SiLU(alpha * (q k^T + attn_bias)) * silu_scale * mask``):
* mask_type 0 (lower-triangular) with ``num_target`` and ``target_group_size=1``: history
  causal, each target sees the history and itself -- our mask without context or window;
* ``silu_scale`` as is (a constant; RecSDK reads 0 as 1/max_seq_len, so it must be > 0);
* the fused relative bias becomes the dense ``attn_bias`` [B, H, L, L] the op takes
  (``dense_relative_bias``, next-event query times included), divided by alpha because RecSDK
  scales the bias with the scores; its gradient reaches the bucket weights through autograd.
Refused with an error (use backend="ascend_triton"): per-position norm (silu_scale=None), a
contextual prefix (RecSDK's num_context also lets context rows see the whole history, ours
only makes context keys visible to all), a look-back window (no such parameter).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from gr.hstu.kernels.common import RelativeBias
from gr.hstu.kernels.pytorch import dense_relative_bias

MASK_TRIL = 0  # RecSDK MaskType.TRIL


def find_mxrec_hstu_jagged() -> Optional[Callable[..., Tensor]]:
    """``torch.ops.mxrec.hstu_jagged`` if RecSDK's op library is loaded, else None."""
    try:
        return torch.ops.mxrec.hstu_jagged
    except (AttributeError, RuntimeError):
        return None


def ascend_hstu_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    max_seq_len: int,
    num_targets: Optional[Tensor],
    contextual_len: int,
    max_attn_len: int,
    alpha: float,
    silu_scale: Optional[float],
    rab: Optional[RelativeBias],
) -> Tensor:
    """See ``gr.hstu.kernels.hstu_attention``; returns [T, H, Dv]."""
    op = find_mxrec_hstu_jagged()
    args = (q, k, v, seq_offsets, max_seq_len, num_targets, contextual_len, max_attn_len, alpha, silu_scale, rab)
    if op is None:
        from gr.hstu.kernels.ascend_triton import ascend_triton_hstu_attention  # needs triton(-ascend)

        return ascend_triton_hstu_attention(*args)
    return mxrec_hstu_attention(op, *args)


def mxrec_hstu_attention(
    op: Callable[..., Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    max_seq_len: int,
    num_targets: Optional[Tensor],
    contextual_len: int,
    max_attn_len: int,
    alpha: float,
    silu_scale: Optional[float],
    rab: Optional[RelativeBias],
) -> Tensor:
    """Our arguments mapped onto RecSDK's ``hstu_jagged`` ``op``; returns [T, H, Dv]."""
    refusals = []
    if silu_scale is None:
        refusals.append("silu_scale=None (per-position norm, HSTUConfig.attn_norm='seq_len')")
    elif silu_scale <= 0:
        refusals.append(f"silu_scale={silu_scale} (RecSDK reads 0 as 1/max_seq_len; must be > 0)")
    if contextual_len > 0:
        refusals.append(f"contextual_len={contextual_len} (its num_context also shows context rows all history)")
    if max_attn_len > 0:
        refusals.append(f"max_attn_len={max_attn_len} (no look-back window)")
    if rab is not None and alpha == 0:
        refusals.append("alpha=0 with a relative bias (the bias is passed divided by alpha)")
    if refusals:
        raise ValueError(
            "hstu_attention[ascend]: torch.ops.mxrec.hstu_jagged cannot express " + "; ".join(refusals)
            + '. Use backend="ascend_triton" (the Triton kernels for NPUs) instead.'
        )
    bias = None
    max_seq_len = int(max_seq_len)
    if rab is not None:
        dense = dense_relative_bias(rab, seq_offsets, num_targets, max_seq_len) / alpha
        bias = dense.to(q.dtype).unsqueeze(1).expand(-1, q.shape[1], -1, -1).contiguous()  # [B, H, L, L]
    out = op(
        q,
        k,
        v,
        mask=None,
        attn_bias=bias,
        mask_type=MASK_TRIL,
        max_seq_len=max_seq_len,
        silu_scale=float(silu_scale),
        seq_offset=seq_offsets.long(),
        num_context=None,
        num_target=num_targets.long() if num_targets is not None else None,
        target_group_size=1,
        alpha=float(alpha),
    )
    return out.view(q.shape[0], q.shape[1], v.shape[-1])
