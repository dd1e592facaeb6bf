"""Memory and work estimates of the ``cpu`` attention backend: what ``gr.train.memory`` sums per layer.

Each mirrors what ``gr.hstu.kernels.attention.cpu`` keeps or computes for one batch (its chunking by
``QUERY_CHUNK`` query rows, tiles of at most ``TILE_ELEMENTS`` scores, fused blocks of ``ROW_BLOCK``
rows, at most ``SAVED_TILE_FLOATS`` saved tile floats and ``LAYOUT_CACHE_ELEMENTS`` cached layout
elements); ``tests/test_plan.py`` holds them to torch's memory profiler.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from gr.hstu.kernels.attention.cpu import (
    LAYOUT_CACHE_ELEMENTS,
    QUERY_CHUNK,
    ROW_BLOCK,
    SAVED_TILE_FLOATS,
    TILE_ELEMENTS,
    padded_lengths,
    sequence_groups,
)
from gr.ops.native import fused_expected

FP32, INT32, INT64 = 4, 4, 8
SCORE_TILES = 4  # score-sized fp32 buffers alive at once in the attention backward (scores, SiLU, gradients)


def score_elements(
    seq_offsets: Tensor, num_targets: Optional[Tensor], heads: int, contextual_len: int = 0, max_attn_len: int = 0
) -> int:
    """How many q.k scores the backend computes for a batch (all heads, padding included).

    seq_offsets: [B+1] int64; num_targets: [B] int64 or None
    """
    groups = sequence_groups(int(seq_offsets[-1]), heads, seq_offsets, num_targets, contextual_len, max_attn_len)
    return sum(g.tokens.shape[0] * heads * (c.m1 - c.m0) * c.cols.numel() for g in groups for c in g.chunks)


def backward_bytes(heads: int, attention_dim: int, linear_dim: int, tokens: int, sequences: int = 1) -> int:
    """Buffers the backward holds for ``sequences`` sequences of ``tokens`` tokens: fp32 q, k, v and
    their gradients, padded and gathered per group (16P - 8A bytes per token, P = heads * (2
    linear_dim + 2 attention_dim), A = heads * linear_dim), and ``SCORE_TILES`` score tiles (a tile
    batches sequences of one length up to ``TILE_ELEMENTS`` scores)."""
    p, a = heads * (2 * linear_dim + 2 * attention_dim), heads * linear_dim
    tile = min(TILE_ELEMENTS, sequences * heads * min(QUERY_CHUNK, tokens) * tokens)
    return sequences * tokens * FP32 * (4 * p - 2 * a) + SCORE_TILES * FP32 * tile


def saved_tile_bytes(heads: int, tokens: int, max_attn_len: int) -> int:
    """The fused tiles of one layer for one sequence of ``tokens`` tokens, kept from forward to
    backward: fp32 weights and SiLU' per head for the keys each block of ``ROW_BLOCK`` query rows
    sees (at most ``SAVED_TILE_FLOATS`` floats a batch, else none are kept); 0 without the fused
    kernels (``gr.ops.native.fused_expected``)."""
    if not fused_expected() or tokens == 0 or 2 * heads * tokens > SAVED_TILE_FLOATS:
        return 0  # (the last: every row sees at least itself, so the tiles are too big to keep)
    padded = int(padded_lengths(torch.tensor([tokens]))[0])
    rows, window, elements = min(padded, QUERY_CHUNK), max_attn_len, 0
    for m0 in range(0, padded, rows):
        lo = max(m0 - window, 0) if window > 0 else 0
        keys = max(0, min(m0 + rows, tokens) - lo)
        for r0 in range(m0, min(m0 + rows, tokens), ROW_BLOCK):
            r1 = min(r0 + ROW_BLOCK, m0 + rows, tokens)
            elements += (r1 - r0) * min(r1 - lo, keys)
    floats = 2 * heads * elements
    return FP32 * floats if floats <= SAVED_TILE_FLOATS else 0


def layout_cache_bytes(time_buckets: int, tokens: int) -> int:
    """The cached layout of one sequence of ``tokens`` tokens, kept from forward to backward: a
    time-bias bucket per (query, key) of each query chunk's padded keys (at most
    ``LAYOUT_CACHE_ELEMENTS`` a batch; for the fused tiles one byte up to 256 buckets, else int32;
    int64 unfused); position buckets and masks are shared by a group."""
    if time_buckets == 0 or tokens == 0:
        return 0
    padded = int(padded_lengths(torch.tensor([tokens]))[0])
    bucket_bytes = (1 if time_buckets <= 256 else INT32) if fused_expected() else INT64
    if padded >= LAYOUT_CACHE_ELEMENTS:  # every query sees at least one key: the cap is reached
        return bucket_bytes * LAYOUT_CACHE_ELEMENTS
    chunks = range(0, padded, QUERY_CHUNK)
    elements = sum((min(m0 + QUERY_CHUNK, padded) - m0) * min(m0 + QUERY_CHUNK, padded) for m0 in chunks)
    return bucket_bytes * min(LAYOUT_CACHE_ELEMENTS, elements)
