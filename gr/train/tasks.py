"""The two training tasks: what a training step feeds the model, its loss, and its evaluation.

Retrieval (autoregressive next-item prediction, sampled softmax). Negatives are drawn
uniformly from the catalogue, per token by default (the HSTU paper's "local" sampling),
per block of tokens (``negatives: block``: tokens are dealt to the blocks in turn, so each
still sees K uniform draws and a sequence's neighbouring tokens never share them; a block's
scores are one matrix product), or shared by every token of the batch (``negatives:
batch``: one [K, d] matrix, far less lookup and memory, a noisier estimate per batch). The
distinct positives and negatives of a batch are looked up once each through the item table
itself, as the extra KJT key ``SAMPLED_ITEMS``, so they go through the same sharded lookup as
the inputs and their gradients reach the table's fused optimizer; the loss then indexes into
those rows.

Ranking: history + candidate tokens; per-task BCE on the PostfixDNN's logits.

Evaluation state is kept per rank and gathered over all ranks at the end of the epoch
(every rank then holds the same metrics); the data module deals disjoint samples to ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from gr.data.features import ITEM_ID
from gr.jagged import target_token_index
from gr.model import GRInput, GROutput
from gr.ops.random import randint
from gr.ops.sampled_softmax import negative_rows, sampled_softmax_loss
from gr.sparse.dedup import unique_ids
from gr.sparse.keyed_jagged import JaggedTensor, KeyedJaggedTensor
from gr.sparse.tables import SparseEmbeddings
from gr.train.build import SAMPLED_ITEMS
from gr.train.config import RankingSection, RetrievalSection
from gr.train.losses import multitask_bce
from gr.train.metrics import (
    per_user_metrics,
    ranking_metrics,
    retrieval_metrics,
    shared_score_ranks,
    target_metrics,
    target_ranks,
)

CPU = torch.device("cpu")
log = logging.getLogger(__name__)
# Draws per catalogue item from which a step looks up every item instead of the distinct drawn
# ones: an item is then missed with probability < e^-8, and finding the distinct ids of ~1.8 M
# draws (ML-1M's recipe) cost more than the rest of the sampling.
WHOLE_CATALOGUE_DRAWS = 8


class RetrievalTask:
    """num_items: catalogue size; item_embedding: item vectors [M, d] -> scored item vectors;
    item_vectors: (item ids [M], their table rows [M, d]) -> item vectors [M, d] in evaluation mode
    (the model's ``ItemTower.item_vectors``), None: the rows themselves. In training the model's
    forward has applied the tower to the sampled items' rows already; new_user: also train the
    new-user query (``GROutput.new_user``) on each sequence's first item; feature_vectors: item ids
    [n] -> their vectors without an id row (``ItemTower.feature_vectors``), which a second sampled
    softmax weighing ``feature_loss_weight`` scores each target by (``feature_loss``)."""

    name = "retrieval"

    def __init__(
        self,
        config: RetrievalSection,
        num_items: int,
        item_embedding: Callable[[Tensor], Tensor],
        item_vectors: Optional[Callable[[Tensor, Tensor], Tensor]] = None,
        new_user: bool = False,
        feature_vectors: Optional[Callable[[Tensor], Tensor]] = None,
        feature_loss_weight: float = 0.0,
    ) -> None:
        if feature_loss_weight > 0 and feature_vectors is None:
            raise ValueError("model.item_tower.feature_loss_weight: needs the item tower's feature vectors")
        self.config = config
        self.num_items = num_items
        self.item_embedding = item_embedding
        self.item_vectors = item_vectors
        self.new_user = new_user
        self.feature_vectors = feature_vectors
        self.feature_loss_weight = feature_loss_weight
        self.catalogue: Optional[Tensor] = None
        self.ranks: Dict[str, List[Tensor]] = {}
        self.users: List[Tensor] = []  # each evaluated target's dataset user id, as ``ranks``

    # ---- training ---------------------------------------------------------------------
    def training_inputs(self, batch: GRInput, generator: torch.Generator) -> GRInput:
        """Add the distinct positives (next items) and sampled negatives as ``SAMPLED_ITEMS`` ids.

        Their rows come back as ``token_features[SAMPLED_ITEMS]`` [U, d] (the whole catalogue when
        the draws outnumber it ``WHOLE_CATALOGUE_DRAWS`` times: an item never drawn then gets a zero
        gradient, a no-op for row-wise Adagrad, a momentum step for Adam); labels
        ``positive_index`` [P] and ``negative_index`` [B, K] (B = ceil(P / ``rows_per_draw``);
        token n's are row n mod B: one row per token when rows_per_draw = 1) or [K] (shared by
        the batch) point into them (P = tokens with a next item). With ``new_user``, the
        sequences' first items (``labels["first_item"]`` >= 0) are targets too, with negatives of
        their own drawn after the tokens' (``batch``: the tokens'): ``first_positive_index`` [F]
        and ``first_negative_index``.
        """
        next_item = batch.labels["next_item"]
        targets = {"": next_item[next_item >= 0]}
        first_item = batch.labels.get("first_item")
        if self.new_user and first_item is not None:
            targets["first_"] = first_item[first_item >= 0].to(next_item.device)
        k, rows = self.config.num_negatives, self.config.rows_per_draw
        drawn: Dict[str, Tensor] = {}
        for group, positives in targets.items():
            if self.config.negatives == "batch" and drawn:
                drawn[group] = drawn[""]  # one draw for every target of the batch
                continue
            shape = (k,) if self.config.negatives == "batch" else (negative_rows(positives.numel(), rows), k)
            drawn[group] = randint(self.num_items, shape, generator).to(positives.device)
        pieces = [t for group in targets for t in (targets[group], drawn[group].reshape(-1))]
        ids = torch.cat(pieces)
        if self.num_items * WHOLE_CATALOGUE_DRAWS <= ids.numel():
            # Nearly every item is drawn: look up the whole catalogue, the ids are their own rows.
            distinct, index = torch.arange(self.num_items, device=ids.device), ids
        else:
            distinct, index = unique_ids(ids, self.num_items)
        indexes = iter(index.split([t.numel() for t in pieces]))
        labels = dict(batch.labels)
        for group in targets:
            labels[f"{group}positive_index"] = next(indexes)
            labels[f"{group}negative_index"] = next(indexes).reshape(drawn[group].shape)
        sequence_ids = batch.sequence_ids
        assert sequence_ids is not None  # a retrieval batch holds its item feature's ids
        features = sequence_ids.to_dict()
        ids_device = sequence_ids.values().device  # the tables' (host memory when placed there)
        lengths = torch.zeros(sequence_ids.stride(), dtype=torch.int64, device=ids_device)
        lengths[0] = distinct.numel()  # one jagged row holding them all: they belong to no sequence
        features[SAMPLED_ITEMS] = JaggedTensor(values=distinct.to(ids_device), lengths=lengths)
        return dataclasses.replace(batch, sequence_ids=KeyedJaggedTensor.from_jt_dict(features), labels=labels)

    def loss(self, output: GROutput, inputs: GRInput) -> Dict[str, Tensor]:
        """{"loss": the sampled softmax over every target, each first-item target weighing
        ``new_user_weight`` tokens, plus ``feature_loss_weight`` times "feature_loss" (``feature_loss``;
        present when that weight is > 0); with first-item targets, also "new_user_loss": theirs alone}."""
        scored = inputs.labels["next_item"] >= 0
        queries = output.predictions["query"]
        if not bool(scored.all()):  # training histories score every token: no copy (and no index_add_) then
            queries = queries.index_select(0, torch.nonzero(scored).flatten())  # backward: index_add_, not index_put_
        items = self.item_embedding(output.token_features[SAMPLED_ITEMS])
        labels = inputs.labels
        loss = sampled_softmax_loss(
            queries,
            items,
            labels["positive_index"],
            labels["negative_index"],
            self.config.temperature,
            self.config.rows_per_draw,
        )
        losses = self.new_user_losses(loss, queries.shape[0], items, output, labels)
        if self.feature_loss_weight > 0:
            feature_loss = self.feature_loss(queries, items, inputs)
            losses["loss"] = losses["loss"] + self.feature_loss_weight * feature_loss
            losses["feature_loss"] = feature_loss.detach()
        return losses

    def new_user_losses(
        self, loss: Tensor, tokens: int, items: Tensor, output: GROutput, labels: Dict[str, Tensor]
    ) -> Dict[str, Tensor]:
        """The tokens' ``loss`` (over ``tokens`` targets) joined by the first-item targets' (``loss``)."""
        first = labels.get("first_positive_index")
        if not output.new_user:
            return {"loss": loss}
        if first is None or first.numel() == 0:  # no first item here: the state still gets its (zero) gradient,
            return {"loss": loss + 0.0 * output.new_user["query"].sum()}  # as data parallelism expects every step
        first_rows = torch.nonzero(labels["first_item"] >= 0).flatten().to(output.new_user["query"].device)
        new_user_loss = sampled_softmax_loss(
            output.new_user["query"].index_select(0, first_rows),
            items,
            first,
            labels["first_negative_index"],
            self.config.temperature,
            self.config.rows_per_draw,
        )
        weight = self.config.new_user_weight * first.numel()
        total = (tokens * loss + weight * new_user_loss) / max(tokens + weight, 1e-12)
        return {"loss": total, "new_user_loss": new_user_loss.detach()}

    def feature_loss(self, queries: Tensor, items: Tensor, inputs: GRInput) -> Tensor:
        """The sampled softmax of each next-item target scored by its features alone
        (``feature_vectors``: no id row, as an item added to an export is) against the negatives of
        the main loss, embedded as the model embeds them (``items`` [U, d]): the encoder learns to
        rank a new item among trained ones. queries: [N, d], one per target. Only the feature-only
        vectors take its gradient (the queries and ``items`` are detached), so it trains the encoder
        alone. A negative that is the target itself is masked, as in the main loss (with negatives
        drawn per row)."""
        assert self.feature_vectors is not None and inputs.sequence_ids is not None  # __init__, training_inputs
        labels, rows = inputs.labels, items.shape[0]
        positives, negatives = labels["positive_index"], labels["negative_index"]
        targets, index = torch.unique(positives, return_inverse=True)
        sampled = inputs.sequence_ids[SAMPLED_ITEMS].values().to(targets.device)
        features = self.item_embedding(self.feature_vectors(sampled[targets]).to(items.dtype))
        own = index + rows  # each target's feature-only row, after the sampled items' rows
        if negatives.dim() == 2 and self.config.rows_per_draw == 1:
            negatives = torch.where(negatives == positives.unsqueeze(1), own.unsqueeze(1), negatives)
        candidates = torch.cat([items.detach(), features])
        return sampled_softmax_loss(
            queries.detach(), candidates, own, negatives, self.config.temperature, self.config.rows_per_draw
        )

    def finish_training_epoch(self) -> Dict[str, float]:
        """What the epoch's training batches tell beside the loss: nothing for retrieval."""
        return {}

    # ---- evaluation -------------------------------------------------------------------
    def start_evaluation(self, embeddings: SparseEmbeddings, ids_device: torch.device = CPU) -> None:
        """Embed the whole catalogue once: each rank looks up a slice, then all gather.

        ids_device: where the tables take their ids."""
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        chunk = math.ceil(self.num_items / world)
        ids = torch.arange(rank * chunk, (rank + 1) * chunk, device=ids_device).clamp(max=self.num_items - 1)
        lengths = torch.tensor([chunk], device=ids_device)
        kjt = KeyedJaggedTensor.from_lengths_sync([self.config.item_feature], ids, lengths)
        with torch.no_grad():
            rows = embeddings(kjt, None)[0][self.config.item_feature]
            if self.item_vectors is not None:
                rows = self.item_vectors(ids, rows)
            if world > 1:
                gathered = [torch.empty_like(rows) for _ in range(world)]
                dist.all_gather(gathered, rows.contiguous())
                rows = torch.cat(gathered)
            self.catalogue = self.item_embedding(rows[: self.num_items])
        self.ranks, self.users = {}, []

    def evaluation_step(self, output: GROutput, inputs: GRInput, popularity: Optional[Tensor] = None) -> None:
        """Rank each held-out item of the batch by the query at its token (``query_rows``); with
        ``popularity`` [I], the most-popular baseline too."""
        rows = query_rows(inputs).to(output.predictions["query"].device)
        self.evaluate_queries(output.predictions["query"].index_select(0, rows), inputs, popularity)

    def evaluate_queries(self, queries: Tensor, inputs: GRInput, popularity: Optional[Tensor] = None) -> None:
        """``evaluation_step`` of queries computed elsewhere (served ones): [S, d], one per held-out item."""
        if self.catalogue is None:
            raise RuntimeError("RetrievalTask: call start_evaluation before evaluation_step")
        labels = inputs.labels
        args = (labels["target_item"], labels["exclude_offsets"], labels["exclude_items"])
        sequences = torch.searchsorted(inputs.seq_offsets[1:], query_rows(inputs), right=True)
        self.users.append(labels["user"][sequences.to(labels["user"].device)].cpu())
        # the evaluation batches' exclusions are distinct (RetrievalEvalBatches)
        self.ranks.setdefault("model", []).append(target_ranks(queries, self.catalogue, *args, distinct=True).cpu())
        if popularity is not None:
            scores = popularity.to(queries.dtype).to(queries.device)
            self.ranks.setdefault("popularity", []).append(shared_score_ranks(scores, *args, distinct=True).cpu())

    def user_metrics(self) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
        """The model's metrics per user over every rank's targets so far (call before
        ``finish_evaluation``) -> (dataset user ids [U] ascending, targets [U] int64,
        {"hr@10": [U] double, ...}): what a paired comparison of two runs on the same users reads."""
        ranks = gather_cat(self.ranks.get("model", []))
        return per_user_metrics(target_metrics(ranks, self.config.top_k), gather_cat(self.users))

    def finish_evaluation(self) -> Dict[str, float]:
        """-> {"hr@10": ..., "mrr": ..., "popularity/hr@10": ...} over every rank's users (each once)."""
        out: Dict[str, float] = {}
        users = gather_cat(self.users)
        for scorer, ranks in self.ranks.items():
            metrics = retrieval_metrics(gather_cat(ranks), self.config.top_k, users)
            prefix = "" if scorer == "model" else f"{scorer}/"
            out.update({f"{prefix}{name}": value for name, value in metrics.items()})
        self.catalogue, self.ranks, self.users = None, {}, []
        return out


def query_rows(inputs: GRInput) -> Tensor:
    """[S] int64 the flat token row whose retrieval query ranks each held-out item of an evaluation
    batch: its ``query_index`` label (a sequence may hold several targets), else each sequence's
    last token."""
    rows = inputs.labels.get("query_index")
    return inputs.seq_offsets[1:] - 1 if rows is None else rows


class RankingTask:
    """tasks: label names; each is a logit [N] of the PostfixDNN and a 0/1 label [N] per candidate.

    Evaluation reports, beside each task's AUC, GAUC (``gauc/<task>``: each user's AUC weighted by
    its candidates) and log loss, its labels' positive rate (``positive_rate/<task>``), and with
    ``popularity`` the AUC and GAUC of ranking the candidates by their item's training count
    (``popularity/auc/<task>``: the baseline a model must beat). A task
    whose labels are all one class, or equal to another task's, is warned about once: its AUC
    says nothing, or the same as the other's."""

    name = "ranking"

    def __init__(self, config: RankingSection, tasks: Sequence[str]) -> None:
        self.config = config
        self.tasks = tuple(tasks)
        self.collected: Dict[str, List[Tensor]] = {}
        self.train_labels: Dict[str, Tensor] = {}  # task -> [positives, labels] this epoch
        self.warned: set = set()

    def training_inputs(self, batch: GRInput, generator: torch.Generator) -> GRInput:
        return batch

    def loss(self, output: GROutput, inputs: GRInput) -> Dict[str, Tensor]:
        logits = {t: output.predictions[t] for t in self.tasks}
        for t in self.tasks:
            label = inputs.labels[t].detach()
            counted = torch.stack([label.sum().float(), torch.tensor(float(label.numel()), device=label.device)])
            self.train_labels[t] = self.train_labels.get(t, 0) + counted
        return multitask_bce(logits, {t: inputs.labels[t] for t in self.tasks}, self.config.task_weights)

    def finish_training_epoch(self) -> Dict[str, float]:
        """-> {"positive_rate/<task>": ...} of the epoch's training labels over every rank."""
        rates = {}
        for task, counted in self.train_labels.items():
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(counted)
            rates[f"positive_rate/{task}"] = float(counted[0] / counted[1].clamp(min=1))
        self.train_labels = {}
        return rates

    def start_evaluation(self, embeddings: SparseEmbeddings, ids_device: torch.device = CPU) -> None:
        self.collected = {}

    def evaluation_step(self, output: GROutput, inputs: GRInput, popularity: Optional[Tensor] = None) -> None:
        """popularity: [num_items] training counts, or None: the candidates' baseline scores."""
        for task in self.tasks:
            self.collected.setdefault(f"logit/{task}", []).append(output.predictions[task].detach().float().cpu())
            self.collected.setdefault(f"label/{task}", []).append(inputs.labels[task].float().cpu())
        if inputs.num_targets is not None and "user" in inputs.labels:  # each candidate's user: GAUC
            users = inputs.labels["user"].cpu().repeat_interleave(inputs.num_targets.cpu())
            self.collected.setdefault("user", []).append(users)
        if popularity is not None and inputs.num_targets is not None and inputs.sequence_ids is not None:
            rows = target_token_index(inputs.seq_offsets, inputs.num_targets)
            items = inputs.sequence_ids[ITEM_ID].values()[rows.to(inputs.sequence_ids.values().device)]
            self.collected.setdefault("popularity", []).append(popularity[items.cpu()].float())

    def finish_evaluation(self) -> Dict[str, float]:
        gathered = {key: gather_cat(values) for key, values in self.collected.items()}
        self.collected = {}
        labels = {t: gathered[f"label/{t}"] for t in self.tasks}
        users = gathered.get("user")
        out = ranking_metrics({t: gathered[f"logit/{t}"] for t in self.tasks}, labels, users)
        out.update(
            {
                f"positive_rate/{t}": float(label.mean()) if label.numel() else float("nan")
                for t, label in labels.items()
            }
        )
        if "popularity" in gathered:
            baseline = ranking_metrics({t: gathered["popularity"] for t in self.tasks}, labels, users)
            out.update(
                {f"popularity/{name}": value for name, value in baseline.items() if name.startswith(("auc", "gauc"))}
            )
        self._warn_degenerate(labels)
        return out

    def _warn_degenerate(self, labels: Dict[str, Tensor]) -> None:
        """Warn (once per task or pair) of a task with one label class, or labels equal to another task's."""
        for i, task in enumerate(self.tasks):
            label = labels[task]
            if label.numel() and label.min() == label.max() and task not in self.warned:
                self.warned.add(task)
                log.warning("ranking task %r: every label is %g; its AUC is undefined", task, float(label[0]))
            for other in self.tasks[:i]:
                if (other, task) not in self.warned and torch.equal(labels[other], label):
                    self.warned.add((other, task))
                    log.warning(
                        "ranking tasks %r and %r have identical labels: they learn and report the same thing "
                        "(check data.ranking.tasks)",
                        other,
                        task,
                    )


def gather_cat(parts: Sequence[Tensor]) -> Tensor:
    """Concatenate this rank's tensors, then every rank's (rank order)."""
    local = torch.cat(list(parts)) if parts else torch.zeros(0)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    everyone: List[Optional[Tensor]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, local)
    return torch.cat([t for t in everyone if t is not None])
