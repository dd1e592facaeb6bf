"""GRTrainingModule: the Lightning module that trains a GRModel and its embedding tables.

The model is built in ``configure_model``. With ``sparse.backend: torchrec`` every rank
builds it from the same seed, then ``shard_model`` wraps it in DistributedModelParallel
(tables sharded over ranks); with ``torch`` it trains as it is, on one rank, its tables plain
torch embeddings (``gr.sparse.torch_tables``, no TorchRec imported). Either way the embedding
optimizers run inside backward, so ``configure_optimizers`` gets the dense parameters only,
and checkpoints hold the same keys.

Exact resume: every random draw of a training step (dropout, sampled negatives,
stochastic-length cuts) comes from generators seeded by (trainer.seed, epoch, batch, rank)
just before the step, and the data module seeds its shuffle by epoch, so an epoch run after
a resume is the same computation as in an uninterrupted run, whatever else drew random
numbers in between.

A non-finite loss or dense gradient stops the run before the optimizer step with a
``NonFiniteError`` naming the step, epoch and batch (also logged); every rank stops at the
same step. Embedding gradients are applied inside backward, so they are not checked here;
a checkpoint with non-finite weights is refused when it is saved.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, cast, overload

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from gr.data.features import FeatureSpec
from gr.data.stochastic_length import subsample_histories
from gr.model import GRInput
from gr.postfix_dnn.item_tower import Column
from gr.sparse.sharding import check_one_rank, table_device
from gr.sparse.torch_tables import prepare_for_training, track_updated_rows
from gr.sparse.touched import Drain, TouchedRows
from gr.train.build import dense_optimizer, seeded_model
from gr.train.config import OptimizerSection, TrainConfig
from gr.train.tasks import RankingTask, RetrievalTask
from gr.train.warm_start import WarmStart
from gr.utils.finite import NonFiniteError, gradients_finite, non_finite

log = logging.getLogger(__name__)
TOUCHED_ROWS = "touched_rows"  # a checkpoint's record of the rows training updated (gr.sparse.touched)
_Destination = TypeVar("_Destination", bound=Dict[str, Any])  # a state_dict destination


class GRTrainingModule(LightningModule):
    """config: the run's TrainConfig; spec: what the data provides; tasks: ranking label
    names; popularity: [num_items] training counts, for the most-popular baseline at test
    (retrieval: ranks of the held-out item; ranking: AUC of the candidates by popularity);
    warm_start: a trained run's weights and table optimizer state to begin from; item_features:
    {item feature: values by model item id} (the data module's), which ``model.item_tower`` reads."""

    def __init__(
        self,
        config: TrainConfig,
        spec: FeatureSpec,
        tasks: Sequence[str] = (),
        popularity: Optional[Tensor] = None,
        warm_start: Optional[WarmStart] = None,
        item_features: Optional[Mapping[str, Column]] = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.warm_start = warm_start
        self.item_features = item_features
        self.spec = spec
        self.tasks = tuple(tasks)
        self.popularity = popularity
        self.model: Any = None  # the GRModel, or TorchRec's DistributedModelParallel around it
        self.table_optimizers: Any = None  # TorchRec's fused optimizer, or gr.sparse.row_optimizers.TableOptimizers
        self.task: Any = None
        self.generator = torch.Generator()
        self.last_metrics: Dict[str, Dict[str, float]] = {}  # split -> the latest evaluation, full precision
        self.step_loss: Optional[Tensor] = None  # the current training step's loss, checked before its optimizer step
        self.step_batch = 0
        self.touched: Optional[TouchedRows] = None  # the rows training updated (trainer.track_rows)
        self.drain_touched: Optional[Drain] = None

    # ---- model -------------------------------------------------------------------------
    def configure_model(self) -> None:
        if self.model is not None:
            return
        sparse, device = self.config.sparse, self.trainer.strategy.root_device
        check_one_rank(sparse.backend, self.trainer.world_size)
        gr_model = seeded_model(self.config, self.spec, self.tasks)
        if gr_model.item_tower is not None:
            if self.item_features is None:
                raise ValueError("model.item_tower: the training module was given no item features (item_features)")
            counts = None if self.popularity is None else self.popularity.numpy()
            gr_model.item_tower.set_items(self.item_features, counts)
        if self.warm_start is not None:
            self.warm_start.copy_weights(gr_model)
        if self.config.task_type == "retrieval":
            item_feature = self.config.task.retrieval.item_feature
            # cast: torch's stubs type a module's attributes (Module.__getattr__) as Tensor | Module
            item_embedding = cast(Callable[[Tensor], Tensor], gr_model.postfix_dnn.item_embedding)
            tower, section = gr_model.item_tower, self.config.model.item_tower
            self.task = RetrievalTask(
                self.config.task.retrieval,
                self.spec.sequence[item_feature],
                item_embedding,
                None if tower is None else tower.item_vectors,
                new_user=gr_model.empty_history is not None,
                feature_vectors=None if tower is None else tower.feature_vectors,
                feature_loss_weight=0.0 if section is None else section.feature_loss_weight,
            )
        else:
            self.task = RankingTask(self.config.task.ranking, self.tasks)
        if sparse.backend == "torch":
            self.table_optimizers = prepare_for_training(gr_model, sparse.optimizer, device, sparse.placement)
            self.model = gr_model
        else:
            from gr.sparse.torchrec_sharding import shard_model  # torchrec: only its backend imports it

            dense_wrapper = None
            if self.dense_sharded:
                from gr.train.fsdp import FSDP2DenseWrapper  # torchrec, as above

                dense_wrapper = FSDP2DenseWrapper(device, torch.distributed.group.WORLD)
            self.model = shard_model(gr_model, sparse.optimizer, device, sparse.placement, dense_wrapper=dense_wrapper)
            self.table_optimizers = self.model.fused_optimizer
        if self.warm_start is not None:
            self.warm_start.copy_table_optimizer_state(self.table_optimizers)
        if self.tracks_rows:
            self._track_rows(gr_model)

    @property
    def tracks_rows(self) -> bool:
        """Whether training records the rows it updates: ``trainer.track_rows``, or publishing."""
        return self.config.trainer.track_rows or self.config.trainer.publish_every is not None

    def _track_rows(self, gr_model: Any) -> None:
        self.touched = TouchedRows({name: t.num_embeddings for name, t in gr_model.embeddings.tables.items()})
        if self.config.sparse.backend == "torch":
            self.drain_touched = track_updated_rows(self.table_optimizers)
        else:
            from gr.sparse.torchrec_sharding import track_updated_rows as track_sharded_rows  # torchrec, as above

            self.drain_touched = track_sharded_rows(self.model)

    @property
    def dense_sharded(self) -> bool:
        """Whether the HSTU stack is sharded over ranks (FSDP2) rather than replicated."""
        return self.config.distributed.dense_sharding == "fsdp2"

    @property
    def gr_model(self) -> torch.nn.Module:
        """The GRModel: inside DistributedModelParallel (its tables sharded), or trained as it is."""
        return self.model if self.config.sparse.backend == "torch" else self.model.module

    def sparse_optimizer_state(self) -> Dict[str, Any]:
        """The embedding optimizers' state (TorchRec: sharded tensors), for checkpoints."""
        return self.table_optimizers.state_dict()

    @overload
    def state_dict(self, *, destination: _Destination, prefix: str = ..., keep_vars: bool = ...) -> _Destination: ...

    @overload
    def state_dict(self, *, prefix: str = ..., keep_vars: bool = ...) -> Dict[str, Any]: ...

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Dict[str, Any]:
        """``model.*``: DistributedModelParallel's state dict (table shards, dense parameters), or the
        GRModel's (the same keys).

        Asked with a prefix, DMP doubles it unless DDP wraps the dense part (with FSDP2 and
        no replicated dense parameter, nothing does), so its state dict is taken unprefixed."""
        state = self.model.state_dict(keep_vars=keep_vars)
        out = destination if destination is not None else {}
        out.update({f"{prefix}model.{k}": v for k, v in state.items()})
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Route "model.*" keys through DistributedModelParallel, which maps them onto the shards."""
        unknown = [k for k in state_dict if not k.startswith("model.")]
        if unknown and strict:
            raise KeyError(f"GRTrainingModule.load_state_dict: unexpected keys {unknown[:5]}")
        return self.model.load_state_dict(
            {k[len("model.") :]: v for k, v in state_dict.items() if k.startswith("model.")}, strict=strict
        )

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        checkpoint["sparse_optimizer"] = self.sparse_optimizer_state()
        if self.touched is not None:  # every rank: the ranks' records are merged
            checkpoint[TOUCHED_ROWS] = self.touched.merged()

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        self.table_optimizers.load_state_dict(checkpoint["sparse_optimizer"])
        if self.touched is not None:  # a checkpoint that tracked nothing: rows are known from its step on
            saved = checkpoint.get(TOUCHED_ROWS)
            if saved is not None:
                self.touched.load(saved)
            else:
                self.touched.since = int(checkpoint.get("global_step", 0))
        if self.config.sparse.backend == "torch":  # Adam's bias correction goes on from the checkpoint's step
            self.table_optimizers.resume_at(int(checkpoint.get("global_step", 0)))

    def dense_parameters(self) -> List[Tuple[str, torch.nn.Parameter]]:
        """(GRModel name, parameter) of each parameter the Lightning optimizer steps, in its order:
        all but the tables' (updated in backward)."""
        if self.config.sparse.backend == "torch":
            tables = {id(p) for p in self.model.embeddings.parameters()}
            return [(n, p) for n, p in self.model.named_parameters() if id(p) not in tables and p.requires_grad]
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        names = {id(p): n for n, p in self.gr_model.named_parameters()}
        dense = in_backward_optimizer_filter(self.model.named_parameters())
        return [(names.get(id(p), n), p) for n, p in dense if p.requires_grad]

    def configure_optimizers(self) -> Any:
        opt = self.config.optimizer
        parameters = self.dense_parameters()
        optimizer = dense_optimizer(opt, [p for _, p in parameters])
        if self.warm_start is not None:
            self.warm_start.copy_dense_optimizer_state(optimizer, parameters)
        if opt.warmup_steps == 0 and opt.lr_decay == "none":
            return optimizer
        total = int(self.trainer.estimated_stepping_batches)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(opt, step, total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _ids_device(self) -> torch.device:
        """Where the tables take ids: host memory, or the dense model's device."""
        return table_device(self.trainer.strategy.root_device, self.config.sparse.placement, self.config.sparse.backend)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Dense tensors to the model's device; ids to the tables' device (host memory when placed there)."""
        if not isinstance(batch, GRInput):
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        ids_device = table_device(device, self.config.sparse.placement, self.config.sparse.backend)

        def move(value: Any, to: torch.device) -> Any:
            if isinstance(value, dict):
                return {k: move(v, to) for k, v in value.items()}
            return value.to(to) if value is not None and hasattr(value, "to") else value

        moved = {f.name: move(getattr(batch, f.name), device) for f in dataclasses.fields(batch)}
        moved["sequence_ids"] = move(batch.sequence_ids, ids_device)
        moved["common_ids"] = move(batch.common_ids, ids_device)
        moved["token_lists"] = move(batch.token_lists, ids_device)
        return GRInput(**moved)

    # ---- training ----------------------------------------------------------------------
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        seed = np.random.SeedSequence([self.config.trainer.seed, self.current_epoch, batch_idx, self.global_rank])
        torch_seed, sampler_seed = (int(s) for s in seed.generate_state(2))
        torch.manual_seed(torch_seed)
        self.generator.manual_seed(sampler_seed)
        if self.drain_touched is not None:
            self.drain_touched()  # lookups since the last training step (evaluation's) updated no row

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Record the rows this step updated, at its global step (counted from 0)."""
        if self.touched is not None and self.drain_touched is not None:
            self.touched.record(self.drain_touched(), self.global_step - 1)

    def training_step(self, batch: GRInput, batch_idx: int) -> Tensor:
        alpha = self.config.trainer.stochastic_length_alpha
        if alpha is not None:
            batch = subsample_histories(batch, self.config.data.max_seq_len, alpha, self.generator)
        inputs = self.task.training_inputs(batch, self.generator)
        output = self.model(inputs)
        losses = self.task.loss(output, inputs)
        size = int(batch.seq_offsets.numel() - 1)
        self.log("train/loss", losses["loss"], prog_bar=True, batch_size=size)
        self.log_dict({f"train/{k}": v for k, v in losses.items() if k != "loss"}, batch_size=size)
        self.step_loss, self.step_batch = losses["loss"].detach(), batch_idx
        return losses["loss"]

    def _logs_this_step(self) -> bool:
        """Whether the step about to be taken is one the loggers write (Lightning's rule: every
        ``log_every_n_steps``-th optimizer step, and the last): the gradient norm is computed only then."""
        every = self.config.trainer.log_every_n_steps
        return (self.trainer.global_step + 1) % every == 0 or self.trainer.should_stop

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Raise NonFiniteError, on every rank, when any rank's loss or dense gradients are not finite;
        on logged steps, log ``train/grad_norm`` (the dense gradients' L2 norm before clipping: the
        tables' gradients are applied inside backward and never held)."""
        named = [(name, p.grad) for name, p in self.model.named_parameters() if p.grad is not None]
        bad_grads = [] if gradients_finite([grad for _, grad in named]) else non_finite(named)
        if self._logs_this_step() and not bad_grads:
            self.log("train/grad_norm", _gradient_norm([grad for _, grad in named]), on_step=True, on_epoch=False)
        loss_finite = self.step_loss is None or bool(self.step_loss.isfinite())
        flags = torch.tensor([float(not loss_finite), float(bool(bad_grads))])
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        if not bool(flags.any()):
            return
        where = (
            f"step {self.global_step} (epoch {self.current_epoch}, batch {self.step_batch}, rank {self.global_rank})"
        )
        if not loss_finite:
            assert self.step_loss is not None  # no loss counts as finite
            what = f"the training loss is {float(self.step_loss)}"
        elif bad_grads:
            what = f"non-finite gradients in {', '.join(bad_grads[:5])}"
        else:
            what = "another rank's loss or gradients are not finite"
        message = (
            f"training diverged at {where}: {what}; nothing was stepped or saved "
            f"(try a lower optimizer.lr / sparse.optimizer.lr, or trainer.gradient_clip_val)"
        )
        log.error(message)
        raise NonFiniteError(message)

    def on_train_epoch_end(self) -> None:
        rates = self.task.finish_training_epoch()  # every rank: it may all-reduce
        if rates:
            self.log_dict({f"train/{k}": v for k, v in rates.items()})

    # ---- evaluation --------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self.task.start_evaluation(self.gr_model.embeddings, self._ids_device())

    def validation_step(self, batch: GRInput, batch_idx: int) -> None:
        self.task.evaluation_step(self.model(batch), batch)

    def on_validation_epoch_end(self) -> None:
        self._log_metrics("val", self.task.finish_evaluation())

    def on_test_epoch_start(self) -> None:
        self.task.start_evaluation(self.gr_model.embeddings, self._ids_device())

    def test_step(self, batch: GRInput, batch_idx: int) -> None:
        self.task.evaluation_step(self.model(batch), batch, self.popularity)

    def on_test_epoch_end(self) -> None:
        self._log_metrics("test", self.task.finish_evaluation())

    def _log_metrics(self, split: str, metrics: Dict[str, float]) -> None:
        self.last_metrics[split] = metrics
        # Gathered over all ranks already, so identical on every rank: the sync is a no-op mean.
        self.log_dict({f"{split}/{k}": v for k, v in metrics.items()}, sync_dist=True)


def _gradient_norm(grads: List[Tensor]) -> Tensor:
    """The L2 norm of all of ``grads`` together: one fused pass per device and dtype (plain tensors;
    others, such as sharded gradients, are left out). A 0-dim float32 tensor."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[Tensor]] = {}
    for grad in grads:
        if type(grad) is Tensor:
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    norms = [norm.float().cpu() for tensors in groups.values() for norm in torch._foreach_norm(tensors)]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def lr_factor(opt: OptimizerSection, step: int, total: int) -> float:
    """The dense learning rate at optimizer step ``step`` (from 0) of ``total``, as a factor of
    optimizer.lr: (step + 1) / warmup_steps over the warm-up, then 1 ("none"), or from 1 down to
    lr_floor at the last step, "linear"ly or on a half cosine."""
    if step < opt.warmup_steps:
        return (step + 1) / opt.warmup_steps
    if opt.lr_decay == "none":
        return 1.0
    done = min(1.0, (step + 1 - opt.warmup_steps) / max(1, total - opt.warmup_steps))
    shape = 1.0 - done if opt.lr_decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
    return opt.lr_floor + (1.0 - opt.lr_floor) * shape
