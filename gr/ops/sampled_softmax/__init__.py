"""Sampled softmax over per-row (or shared) negatives: the retrieval loss.

* ``cpu``: gr's fused kernel (``sampled_softmax.cpp``, namespace ``gr_cpu_loss`` of ``gr.ops.native``)
  for per-row negatives on CPU tensors with an item table of at most ``cpu.MAX_TABLE_ELEMENTS``;
* ``pytorch``: any device; row tiles against all items when there are fewer distinct items than
  gathered values, else a gather of each row's negatives.

Both backends take one ``SampledSoftmaxCall`` (``common``), checked once here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gr.ops.native import cpu_bf16_math, native_ops
from gr.ops.sampled_softmax import cpu, pytorch
from gr.ops.sampled_softmax.common import SampledSoftmaxCall, negative_rows

__all__ = ["SampledSoftmaxCall", "negative_rows", "sampled_softmax_loss"]


def sampled_softmax_loss(
    queries: Tensor,
    items: Tensor,
    positive_index: Tensor,
    negative_index: Tensor,
    temperature: float,
    rows_per_draw: int = 1,
) -> Tensor:
    """Mean over rows of -log softmax of the positive among itself and the row's negatives.

    queries: [N, d] float; items: [U, d] float, the distinct sampled items' vectors
    positive_index: [N] int64, each row's true next item (a row of ``items``)
    negative_index: [B, K] int64 with B = ceil(N / rows_per_draw): row n's negatives are row
        n mod B (rows_per_draw = 1: one per row; more: the rows are dealt to B blocks in turn,
        so neighbouring rows never share) or [K] int64 (shared by all rows)
    Logits are dot products / temperature (cosines when both sides are unit vectors). A
    negative that is the row's own positive is masked out, so it is never pushed down.
    Under CPU/CUDA autocast the dot products run in the autocast dtype (bf16: fp32
    accumulation, bf16 logits), the softmax in fp32.
    returns: scalar
    """
    call = SampledSoftmaxCall(queries, items, positive_index, negative_index, temperature, rows_per_draw)
    call.validate()
    if negative_index.dim() == 2 and queries.device.type == "cpu" and items.numel() <= cpu.MAX_TABLE_ELEMENTS:
        ops = native_ops("gr_cpu_loss")
        if ops is not None:
            bf16 = cpu_bf16_math()
            with torch.autocast("cpu", enabled=False):
                return cpu.sampled_softmax(call, ops=ops, bf16=bf16)
    return pytorch.sampled_softmax(call)
