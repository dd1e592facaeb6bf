"""A Lightning DDP strategy for a LightningModule whose model is a TorchRec DistributedModelParallel
(``sparse.backend: torchrec``), or a plain GRModel on one rank (``sparse.backend: torch``, which
needs nothing more: no wrapping, moving or broadcast either, and the same DCP checkpoints).

Lightning's DDPStrategy would wrap the whole module in DDP (which fails on sharded
tables), move it to one device, broadcast rank 0's parameters at evaluation (overwriting
the other ranks' table shards) and save rank 0's state only. Here the module builds its
DMP in ``configure_model`` (DMP does DDP for the dense part itself), nothing is wrapped,
moved or broadcast, and checkpoints go through DCP (``gr.train.checkpoint``) on every rank.

With the HSTU stack sharded by FSDP2 (``distributed.dense_sharding: fsdp2``) the dense
optimizer's state is sharded too: it is keyed by parameter name and saved through DCP with
the rest (``get_optimizer_state_dict``, which also creates the state of an optimizer that
has not stepped yet, so it serves as the template a checkpoint loads into), and a resume
loads it after the optimizers exist (``restore_checkpoint_after_setup``).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.optim import Optimizer

from gr.train import checkpoint as ckpt
from gr.train.module import GRTrainingModule


class TorchRecStrategy(DDPStrategy):
    strategy_name = "torchrec_ddp"

    def setup(self, trainer: Any) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            super().setup(trainer)
            return
        # Evaluation: DMP keeps ranks consistent; skip DDPStrategy's broadcast of parameters.
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.setup_precision_plugin()

    def configure_ddp(self) -> None:
        """The model is already a DistributedModelParallel (sharded tables + DDP over dense parameters)."""

    def model_to_device(self) -> None:
        """DistributedModelParallel placed tables and dense modules when it was built."""

    @property
    def gr_module(self) -> GRTrainingModule:
        """The module trained, a GRTrainingModule (the only kind this strategy runs)."""
        module = self.lightning_module
        assert isinstance(module, GRTrainingModule)
        return module

    @property
    def dense_sharded(self) -> bool:
        return bool(getattr(self.lightning_module, "dense_sharded", False))

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Sharded dense optimizer state loads into the optimizers, which exist only after setup."""
        return self.dense_sharded

    def optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        if not self.dense_sharded:
            return super().optimizer_state(optimizer)
        return get_optimizer_state_dict(self.gr_module.gr_model, getattr(optimizer, "_optimizer", optimizer))

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self.dense_sharded:
            super().load_optimizer_state_dict(checkpoint)
            return
        for optimizer, state in zip(self.optimizers, checkpoint[ckpt.DENSE_OPTIMIZER_KEY]):
            set_optimizer_state_dict(self.gr_module.gr_model, optimizer, optim_state_dict=state)

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        dense = (ckpt.DENSE_OPTIMIZER_KEY,) if self.dense_sharded else ()
        ckpt.save_checkpoint(checkpoint, filepath, (*ckpt.SHARDED_KEYS, *dense))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        module = self.gr_module
        template: Dict[str, Any] = {
            "state_dict": module.state_dict(),
            "sparse_optimizer": module.sparse_optimizer_state(),
        }
        if self.dense_sharded and self.optimizers:
            template[ckpt.DENSE_OPTIMIZER_KEY] = [get_optimizer_state_dict(module.gr_model, o) for o in self.optimizers]
        return ckpt.load_checkpoint(template, checkpoint_path)

    def remove_checkpoint(self, filepath: Any) -> None:
        ckpt.remove_checkpoint(filepath)
