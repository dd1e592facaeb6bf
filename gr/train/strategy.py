"""A Lightning DDP strategy for a LightningModule whose model is a TorchRec DistributedModelParallel.

Lightning's DDPStrategy would wrap the whole module in DDP (which fails on sharded
tables), move it to one device, broadcast rank 0's parameters at evaluation (overwriting
the other ranks' table shards) and save rank 0's state only. Here the module builds its
DMP in ``configure_model`` (DMP does DDP for the dense part itself), nothing is wrapped,
moved or broadcast, and checkpoints go through DCP (``gr.train.checkpoint``) on every rank.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

from gr.train import checkpoint as ckpt


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

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        ckpt.save_checkpoint(checkpoint, filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        module = self.lightning_module
        template = {"state_dict": module.state_dict(), "sparse_optimizer": module.sparse_optimizer_state()}
        return ckpt.load_checkpoint(template, checkpoint_path)

    def remove_checkpoint(self, filepath: Any) -> None:
        ckpt.remove_checkpoint(filepath)
