"""Evaluation metrics: full-catalogue ranking (retrieval) and AUC / log loss (ranking)."""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.functional.classification import binary_auroc

from gr.jagged import token_seq_ids
from gr.ops.catalogue_rank import catalogue_ranks, shared_ranks

# Score rows per chunk when ranking a big catalogue: bounds the [rows, items] score matrix.
SCORE_CHUNK_ELEMENTS = 1 << 24


def target_ranks(
    queries: Tensor,
    items: Tensor,
    targets: Tensor,
    exclude_offsets: Tensor,
    exclude_items: Tensor,
    distinct: bool = False,
) -> Tensor:
    """0-based rank of each target among the catalogue, excluded items left out.

    queries: [B, d] float; items: [I, d] float (the whole catalogue, scored by dot product)
    targets: [B] int64 item ids; exclude_offsets: [B+1] int64; exclude_items: [E] int64,
    the items not ranked for each query (a target listed there is still ranked); distinct: each
    query's are known to be distinct (an evaluation batch's), which skips looking for repeats.
    Ties are broken by item id, as a stable sort of (-score, id) would: the rank is the
    number of kept items scoring above the target, plus those tying it with a smaller id.
    Non-finite scores rank last: a NaN or infinite item never ranks above a finite target,
    and a target scored NaN or infinite gets rank I (never a hit), so a diverged model
    scores 0, not a perfect 1.
    returns: [B] int64
    """
    rows = max(1, SCORE_CHUNK_ELEMENTS // max(1, items.shape[0]))
    ranks = []
    for start in range(0, queries.shape[0], rows):
        stop = min(start + rows, queries.shape[0])
        scores = queries[start:stop] @ items.T
        ranks.append(_ranks(scores, targets[start:stop], exclude_offsets[start : stop + 1], exclude_items, distinct))
    return torch.cat(ranks) if ranks else targets.new_zeros(0)


def score_ranks(scores: Tensor, targets: Tensor, exclude_offsets: Tensor, exclude_items: Tensor) -> Tensor:
    """Like ``target_ranks`` for precomputed scores: [B, I] float (e.g. item popularity per row)."""
    return _ranks(scores.clone(), targets, exclude_offsets, exclude_items)


def shared_score_ranks(
    scores: Tensor, targets: Tensor, exclude_offsets: Tensor, exclude_items: Tensor, distinct: bool = False
) -> Tensor:
    """``score_ranks`` of one score vector every row shares (scores: [I] float, e.g. item popularity):
    [B] int64, the same ranks from one sort of the catalogue and the excluded items instead of a
    [B, I] matrix (``gr.ops.catalogue_rank.shared_ranks``); distinct as ``target_ranks`` reads it."""
    if not bool(scores.isfinite().all()):
        return score_ranks(scores.expand(targets.numel(), -1), targets, exclude_offsets, exclude_items)
    return shared_ranks(scores, targets, exclude_offsets, exclude_items, distinct)


def _ranks(
    scores: Tensor, targets: Tensor, exclude_offsets: Tensor, exclude_items: Tensor, distinct: bool = False
) -> Tensor:
    """scores: [R, I] (overwritten when some score is not finite); exclude_offsets: [R+1] int64 positions
    into exclude_items (a chunk's: offsets[0] may be above 0) -> [R] int64 ranks (``target_ranks``)."""
    if bool(scores.sum().isfinite()):
        return catalogue_ranks(scores, targets, exclude_offsets, exclude_items, distinct)
    start, stop = int(exclude_offsets[0]), int(exclude_offsets[-1])
    scores[token_seq_ids(exclude_offsets - start, stop - start), exclude_items[start:stop]] = float("-inf")
    scores[~scores.isfinite()] = float("-inf")  # excluded and non-finite items never rank above a target
    target_scores = scores[torch.arange(scores.shape[0], device=scores.device), targets].unsqueeze(1)
    ids = torch.arange(scores.shape[1], device=scores.device)
    above = scores > target_scores
    tied_before = (scores == target_scores) & (ids.unsqueeze(0) < targets.unsqueeze(1))
    ranks = (above | tied_before).sum(1)
    return torch.where(target_scores.squeeze(1).isfinite(), ranks, scores.shape[1])


def retrieval_metrics(ranks: Tensor, top_k: Sequence[int], users: Optional[Tensor] = None) -> Dict[str, float]:
    """ranks: [S] int64 0-based target ranks; users: [S] int64 each target's user (None: one target
    per user) -> HR@k, NDCG@k (one relevant item), MRR. Each user counts once: a user's targets
    are averaged first when some user has several."""
    values = target_metrics(ranks, top_k)
    if users is None or users.unique().numel() == users.numel():
        return {name: value.mean().item() for name, value in values.items()}
    return {name: value.mean().item() for name, value in per_user_metrics(values, users)[2].items()}


def target_metrics(ranks: Tensor, top_k: Sequence[int]) -> Dict[str, Tensor]:
    """ranks: [S] int64 0-based target ranks -> {"hr@k", "ndcg@k" for each k, "mrr": [S] double},
    each target's hit, discounted gain and reciprocal rank."""
    ranks = ranks.double()
    out: Dict[str, Tensor] = {}
    for k in top_k:
        hit = ranks < k
        out[f"hr@{k}"] = hit.double()
        out[f"ndcg@{k}"] = torch.where(hit, 1.0 / torch.log2(ranks + 2.0), torch.zeros_like(ranks))
    out["mrr"] = 1.0 / (ranks + 1.0)
    return out


def per_user_metrics(values: Dict[str, Tensor], users: Tensor) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """values: {metric: [S] double} per target (``target_metrics``); users: [S] int64 each target's
    user -> (user ids [U] ascending, targets per user [U] int64, {metric: [U] double, each user's
    mean over its targets})."""
    unique, owner = torch.unique(users, return_inverse=True)
    counts = torch.bincount(owner, minlength=unique.numel())
    means = {
        name: value.new_zeros(unique.numel()).index_add_(0, owner, value) / counts for name, value in values.items()
    }
    return unique, counts, means


def ranking_metrics(
    logits: Dict[str, Tensor], labels: Dict[str, Tensor], users: Optional[Tensor] = None
) -> Dict[str, float]:
    """Per task: AUC and log loss of logits [N] against 0/1 labels [N]; with ``users`` [N] (each
    candidate's user), GAUC too (``grouped_auc``); "auc"/"logloss"/"gauc": task means.

    A task whose labels are all equal, or whose logits are not all finite, has no AUC (NaN).
    """
    out: Dict[str, float] = {}
    for task, logit in logits.items():
        label = labels[task].float()
        finite = bool(logit.isfinite().all())
        defined = 0 < int(label.sum()) < label.numel() and finite
        out[f"auc/{task}"] = binary_auroc(logit, label.long()).item() if defined else float("nan")
        out[f"logloss/{task}"] = F.binary_cross_entropy_with_logits(logit, label).item()
        if users is not None:
            out[f"gauc/{task}"] = grouped_auc(logit, label, users) if finite else float("nan")
    for metric in ("auc", "logloss", *(("gauc",) if users is not None else ())):
        values = torch.tensor([out[f"{metric}/{task}"] for task in logits], dtype=torch.float64)
        out[metric] = values.mean().item()
    return out


def grouped_auc(logits: Tensor, labels: Tensor, groups: Tensor) -> float:
    """GAUC: each group's AUC (ties count half) weighted by its number of candidates, over the
    groups that hold both classes; NaN when none does. logits / labels (0/1) / groups: [N].
    Each user counts by its own candidates instead of being compared with every other user's."""
    if logits.numel() == 0:
        return float("nan")
    order = torch.argsort(logits.double(), stable=True)
    order = order[torch.argsort(groups[order], stable=True)]
    group, score, label = groups[order], logits[order].double(), labels[order].double()
    _, group_index, counts = torch.unique_consecutive(group, return_inverse=True, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(len(group), dtype=torch.float64) - starts[group_index].double() + 1  # 1-based in group
    run = torch.cat([torch.zeros(1, dtype=torch.long), ((group[1:] != group[:-1]) | (score[1:] != score[:-1])).long()])
    run = torch.cumsum(run, 0)  # equal scores of one group share a run: they get its mean rank
    run_sizes = torch.bincount(run).double()
    mean_rank = torch.zeros(len(run_sizes), dtype=torch.float64).index_add_(0, run, position) / run_sizes
    groups_n = len(counts)
    positives = torch.zeros(groups_n, dtype=torch.float64).index_add_(0, group_index, label)
    negatives = counts.double() - positives
    rank_sum = torch.zeros(groups_n, dtype=torch.float64).index_add_(0, group_index, mean_rank[run] * label)
    both = (positives > 0) & (negatives > 0)
    if not bool(both.any()):
        return float("nan")
    auc = (rank_sum[both] - positives[both] * (positives[both] + 1) / 2) / (positives[both] * negatives[both])
    weights = counts[both].double()
    return float((auc * weights).sum() / weights.sum())
