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
* ``num_context`` zeros [B] whenever ``num_target`` is given: the backward requires both.

``mxrec_misfits`` lists what the op cannot take, checked up front; with ``backend="auto"`` on
an NPU a misfit falls back to ``ascend_triton`` with the reason logged, with
``backend="ascend"`` it is an error. What our mapping cannot express: per-position norm
(silu_scale=None), a contextual prefix (RecSDK's num_context also lets context rows see the
whole history, ours only makes context keys visible to all), a look-back window (no such
parameter). The op's own limits, read in RecSDK's source (Ascend/RecSDK,
cust_op/framework/torch_plugin/torch_library/hstu/hstu_jagged.cpp and its 2.6.0/ copy, the
TORCH_CHECKs of ``hstu_jagged_backward_impl_npu``):
* head dim in [16, 512] ("headDim expect in [16, 512]"), heads in [1, 16], batch in
  [1, 2048], max_seq_len in [1, 20480]; a multiple of 16 for the head dim is the
  ``MULTIPLE_HEAD_DIM_TIMES`` of that check (its value not seen: taken as 16 from the issue);
* backward: ``q.sizes() == k.sizes()`` and ``q.sizes() == v.sizes()``, so attention_dim must
  equal linear_dim when gradients are needed;
* ``attn_bias`` 4-D [B, H, max_seq_len, max_seq_len] in the grad's dtype;
* ``numContext is required when numTarget ... is not None``; target_group_size in {1, 3};
* ``alpha``: in the schema of the stored version (``float? alpha=1.0``), absent from calls in
  other RecSDK versions' tests, so it is looked up in the op's schema: without it, alpha must be 1.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable, List, Optional

import torch
from torch import Tensor

from gr.hstu.kernels.attention.common import AttentionCall
from gr.hstu.kernels.attention.pytorch import dense_relative_bias

MASK_TRIL = 0  # RecSDK MaskType.TRIL
HEAD_DIM_RANGE = (16, 512)
HEAD_DIM_MULTIPLE = 16
MAX_HEADS = 16
MAX_BATCH = 2048
MAX_SEQ_LEN = 20480

log = logging.getLogger(__name__)


def find_mxrec_hstu_jagged() -> Optional[Callable[..., Tensor]]:
    """``torch.ops.mxrec.hstu_jagged`` if RecSDK's op library is loaded, else None."""
    try:
        return torch.ops.mxrec.hstu_jagged
    except (AttributeError, RuntimeError):
        return None


def ascend_hstu_attention(call: AttentionCall, *, explicit: bool = True) -> Tensor:
    """See ``gr.hstu.kernels.attention.hstu_attention``; returns [T, H, Dv]. ``explicit`` False (backend
    "auto"): a call the RecSDK op cannot take falls back to ``ascend_triton`` with a logged reason."""
    op = find_mxrec_hstu_jagged()
    if op is not None:
        misfits = mxrec_misfits(op, call)
        if not misfits:
            return mxrec_hstu_attention(op, call)
        reason = "torch.ops.mxrec.hstu_jagged cannot take " + "; ".join(misfits)
        if explicit:
            raise ValueError(
                f'hstu_attention[ascend]: {reason}. Use backend="ascend_triton" (the Triton '
                'kernels for NPUs) or "auto" (falls back to them)'
            )
        log.warning("hstu_attention[auto]: %s; running ascend_triton instead", reason)
    from gr.hstu.kernels.attention.ascend_triton import ascend_triton_hstu_attention  # needs triton(-ascend)

    return ascend_triton_hstu_attention(call)


def op_takes_alpha(op: Callable[..., Tensor]) -> bool:
    """Whether this RecSDK version's ``hstu_jagged`` has an ``alpha`` argument (its schema, or
    the signature of a Python stand-in)."""
    overloads = getattr(op, "overloads", None)
    if overloads is not None:
        return any(arg.name == "alpha" for name in overloads() for arg in getattr(op, name)._schema.arguments)
    return "alpha" in inspect.signature(op).parameters


def mxrec_misfits(op: Callable[..., Tensor], call: AttentionCall) -> List[str]:
    """Why RecSDK's ``op`` cannot take this call (empty: it can); see the module docstring."""
    q, v, seq_offsets, max_seq_len, alpha = call.q, call.v, call.seq_offsets, call.max_seq_len, call.alpha
    silu_scale, contextual_len, max_attn_len, rab = call.silu_scale, call.contextual_len, call.max_attn_len, call.rab
    misfits = []
    if silu_scale is None:
        misfits.append("silu_scale=None (per-position norm, HSTUConfig.attn_norm='seq_len')")
    elif silu_scale <= 0:
        misfits.append(f"silu_scale={silu_scale} (RecSDK reads 0 as 1/max_seq_len; must be > 0)")
    if contextual_len > 0:
        misfits.append(f"contextual_len={contextual_len} (its num_context also shows context rows all history)")
    if max_attn_len > 0:
        misfits.append(f"max_attn_len={max_attn_len} (no look-back window)")
    if rab is not None and alpha == 0:
        misfits.append("alpha=0 with a relative bias (the bias is passed divided by alpha)")
    if alpha != 1.0 and not op_takes_alpha(op):
        misfits.append(f"alpha={alpha} (this RecSDK version's hstu_jagged has no alpha argument)")
    low, high = HEAD_DIM_RANGE
    for name, dim in (("attention_dim (q, k head dim)", q.shape[2]), ("linear_dim (v head dim)", v.shape[2])):
        if not low <= dim <= high or dim % HEAD_DIM_MULTIPLE:
            misfits.append(f"{name}={dim} (must be a multiple of {HEAD_DIM_MULTIPLE} in [{low}, {high}])")
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, call.k, v)) and q.shape != v.shape:
        misfits.append(
            f"attention_dim {q.shape[2]} != linear_dim {v.shape[2]} with gradients (its backward "
            "needs q, k, v of one size)"
        )
    if q.shape[1] > MAX_HEADS:
        misfits.append(f"num_heads={q.shape[1]} (at most {MAX_HEADS})")
    if seq_offsets.numel() - 1 > MAX_BATCH:
        misfits.append(f"batch={seq_offsets.numel() - 1} (at most {MAX_BATCH})")
    if int(max_seq_len) > MAX_SEQ_LEN:
        misfits.append(f"max_seq_len={int(max_seq_len)} (at most {MAX_SEQ_LEN})")
    return misfits


def mxrec_hstu_attention(op: Callable[..., Tensor], call: AttentionCall) -> Tensor:
    """Our arguments mapped onto RecSDK's ``hstu_jagged`` ``op`` (a call ``mxrec_misfits``
    accepts); returns [T, H, Dv]."""
    q, k, v, seq_offsets, num_targets = call.q, call.k, call.v, call.seq_offsets, call.num_targets
    rab, alpha = call.rab, call.alpha
    bias = None
    max_seq_len = int(call.max_seq_len)
    if rab is not None:
        dense = dense_relative_bias(rab, seq_offsets, num_targets, max_seq_len) / alpha
        bias = dense.to(q.dtype).unsqueeze(1).expand(-1, q.shape[1], -1, -1).contiguous()  # [B, H, L, L]
    targets = num_targets.long() if num_targets is not None else None
    options = dict(alpha=float(alpha)) if op_takes_alpha(op) else {}
    assert call.silu_scale is not None  # mxrec_misfits turns None away
    out = op(
        q,
        k,
        v,
        mask=None,
        attn_bias=bias,
        mask_type=MASK_TRIL,
        max_seq_len=max_seq_len,
        silu_scale=float(call.silu_scale),
        seq_offset=seq_offsets.long(),
        num_context=torch.zeros_like(targets) if targets is not None else None,
        num_target=targets,
        target_group_size=1,
        **options,
    )
    return out.view(q.shape[0], q.shape[1], v.shape[-1])
