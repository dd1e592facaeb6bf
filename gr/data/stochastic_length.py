"""Stochastic length (Zhai et al. 2024, section 3.2): sparser long histories at training time.

With N the longest history (``data.max_seq_len``) and ``alpha`` in (1, 2], a history of
n tokens is kept whole when n <= N^(alpha/2); a longer one is kept whole with probability
N^alpha / n^2 and otherwise cut to N^(alpha/2) of its tokens, chosen uniformly and kept in
order. Expected attention work per sequence then grows as N^alpha instead of N^2. Target
tokens (the trailing ``num_targets``) are always kept. Each kept token keeps its own
labels (for retrieval: the item that really came next), so the model learns to predict
from a sparser history. Training only: evaluation always sees whole histories.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor

from gr.jagged import history_lengths, lengths_from_offsets, offsets_from_lengths
from gr.model import GRInput
from gr.sparse.keyed_jagged import JaggedTensor, KeyedJaggedTensor


def kept_length(max_len: int, alpha: float) -> int:
    """N^(alpha/2): the longest history always kept whole, and the length others are cut to."""
    return max(1, int(math.floor(max_len ** (alpha / 2))))


def keep_whole_probability(history: Tensor, max_len: int, alpha: float) -> Tensor:
    """history: [B] int64 history lengths -> [B] float: 1 up to N^(alpha/2), else N^alpha / n^2."""
    n = history.double()
    return torch.where(
        history <= kept_length(max_len, alpha),
        torch.ones_like(n),
        (max_len**alpha / n.clamp(min=1) ** 2).clamp(max=1.0),
    )


def stochastic_length_index(
    seq_offsets: Tensor, num_targets: Tensor | None, max_len: int, alpha: float, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Which tokens to keep.

    seq_offsets: [B+1] int64; num_targets: [B] int64 or None
    returns: (index [T'] int64 into the batch's tokens, in order; lengths [B] int64 of the kept sequences)
    """
    history = history_lengths(seq_offsets, num_targets).cpu()
    offsets = seq_offsets.cpu()
    lengths = lengths_from_offsets(offsets)
    draws = torch.rand(history.shape, generator=generator, dtype=torch.float64)
    cut = draws >= keep_whole_probability(history, max_len, alpha)
    short = kept_length(max_len, alpha)
    pieces, kept = [], lengths.clone()
    for b in range(history.numel()):
        start, n = int(offsets[b]), int(history[b])
        if cut[b]:
            chosen = torch.randperm(n, generator=generator)[:short].sort().values + start
            pieces += [chosen, torch.arange(start + n, int(offsets[b + 1]))]
            kept[b] = short + lengths[b] - n
        else:
            pieces.append(torch.arange(start, int(offsets[b + 1])))
    index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
    return index.to(seq_offsets.device), kept.to(seq_offsets.device)


def subsample_histories(batch: GRInput, max_len: int, alpha: float, generator: torch.Generator) -> GRInput:
    """``batch`` with long histories cut as described in the module docstring.

    Per-token fields follow the kept tokens: timestamps, query_times, every key of ``sequence_ids``,
    ``token_dense``, and the labels of an autoregressive batch (no ``num_targets``: one label
    row per token); labels of target tokens are untouched (targets are all kept).
    """
    index, lengths = stochastic_length_index(batch.seq_offsets, batch.num_targets, max_len, alpha, generator)
    total = int(batch.seq_offsets[-1])
    if index.numel() == total:
        return batch
    ids = batch.sequence_ids
    if ids is not None:
        ids_index, ids_lengths = index.to(ids.values().device), lengths.to(ids.values().device)
        ids = KeyedJaggedTensor.from_jt_dict(
            {
                key: JaggedTensor(values=jagged.values()[ids_index], lengths=ids_lengths)
                for key, jagged in ids.to_dict().items()
            }
        )
    labels = batch.labels
    if batch.num_targets is None:
        labels = {k: v[index] if v.dim() > 0 and v.shape[0] == total else v for k, v in labels.items()}
    return dataclasses.replace(
        batch,
        seq_offsets=offsets_from_lengths(lengths),
        max_seq_len=int(lengths.max()) if lengths.numel() else batch.max_seq_len,
        timestamps=None if batch.timestamps is None else batch.timestamps[index],
        query_times=None if batch.query_times is None else batch.query_times[index],
        sequence_ids=ids,
        token_dense={k: v[index] for k, v in batch.token_dense.items()},
        labels=labels,
    )
