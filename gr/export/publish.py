"""Near-real-time publishing: a training run writes a delta export every ``trainer.publish_every``
steps or seconds into ``trainer.publish_dir``, a chain a service follows (docs/export_format.md,
"Publishing from a training run").

The directory holds the chain by number: ``000000``, a full export (unless ``trainer.publish_base``
names the export the chain starts from: the deltas then start at ``000001``), then ``000001``,
``000002``, ... each the delta from the one before (``gr.export.delta``), its rows those training
updated since (``gr.sparse.touched``). Each is written to a temporary sibling and renamed: complete
or absent. ``gr check [BASE] DIR/000000 DIR/000001 ...`` accepts the chain, and a service applies
each new number with ``/admin/reload`` (``delta``). ``.base`` beside them is the full export of
the newest one, which the next delta is taken against (not part of the chain). While a publish
runs, the model is a checkpoint in ``<run>/publish`` (every rank writes its table shards), which
rank 0 exports and removes.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from gr.export.delta import export_identity, is_delta, read_delta
from gr.export.format import ExportFormatError, Problem
from gr.export.writer import check_lineage, export_checkpoint
from gr.train.config import TrainConfig, publish_interval
from gr.utils.atomic import replace_directory
from gr.utils.outputs import checked_output

log = logging.getLogger(__name__)
PUBLISH_CHECKPOINT = "publish"  # in the run directory, while a publish exports it
BASE, NEXT = ".base", ".next"  # in the publish directory: the newest export in full, and the one being written
NAME_DIGITS = 6


def published(directory: Path) -> List[Path]:
    """The exports published into ``directory``, in chain order (names of digits)."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def made_identity(export: Path) -> str:
    """The identity of the full export ``export`` is (a full export) or makes (a delta)."""
    if not is_delta(export):
        return export_identity(export)
    problems: List[Problem] = []
    delta = read_delta(export, problems)
    if delta is None:
        raise ExportFormatError([Problem(f"{export}/{p.file}", p.key, p.message) for p in problems])
    return delta.target


class Publisher(Callback):
    """Publishes the model of the run in ``run_dir`` as ``config.trainer`` says (``publish_every``,
    ``publish_dir``, ``publish_base``), after the training steps it falls on and when training ends. A ``publish_dir``
    that is, holds or lies inside the run or its data is a ValueError, as is one holding a chain
    whose newest export is not the one kept in ``.base`` (a publish cut short there)."""

    def __init__(self, config: TrainConfig, run_dir: Path) -> None:
        trainer = config.trainer
        assert trainer.publish_every is not None and trainer.publish_dir is not None  # validated together
        self.steps, self.seconds = publish_interval(trainer.publish_every)
        self.run_dir = Path(run_dir)
        run: List[Tuple[str, Optional[Union[str, Path]]]] = [("RUN_DIR", self.run_dir)]
        self.directory = checked_output(trainer.publish_dir, [*run, *config.data.inputs()], "trainer.publish_dir")
        self.first_base = None if trainer.publish_base is None else Path(trainer.publish_base)
        self.last_time = 0.0
        self.published_step = 0  # the training step of the model published last (or training started at)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.last_time = time.monotonic()
        self.published_step = trainer.global_step
        if not trainer.is_global_zero:
            return
        if self.first_base is not None:
            check_lineage(self.run_dir, self.first_base)
        chain = published(self.directory)
        kept = self.directory / BASE
        if chain and not (kept.is_dir() and export_identity(kept) == made_identity(chain[-1])):
            raise ValueError(
                f"trainer.publish_dir: {self.directory} holds exports up to {chain[-1].name}, but {BASE} there is "
                "not the full export of it (a publish cut short): publish into another directory"
            )

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if self._due(trainer.global_step):
            self.publish(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The model training ends with is published too, unless it already is (its step fell on the
        interval) or training took no step: the chain ends at the run's last step."""
        if trainer.global_step != self.published_step:
            self.publish(trainer)

    def _due(self, step: int) -> bool:
        """Whether a publish falls after training step ``step`` (counted from 1); by time, rank 0's clock decides."""
        if self.steps:
            return step % self.steps == 0
        due = torch.tensor([float(time.monotonic() - self.last_time >= self.seconds)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(due, src=0)
        return bool(due.item())

    def publish(self, trainer: Trainer) -> Optional[Path]:
        """Publish the model as it is now (every rank calls it) -> the export written (rank 0), else None."""
        checkpoint = self.run_dir / PUBLISH_CHECKPOINT
        trainer.save_checkpoint(checkpoint)
        written = None
        if trainer.is_global_zero:
            try:
                written = self._export(checkpoint, trainer.global_step)
            finally:
                shutil.rmtree(checkpoint, ignore_errors=True)
        trainer.strategy.barrier()
        self.last_time, self.published_step = time.monotonic(), trainer.global_step
        return written

    def _export(self, checkpoint: Path, step: int) -> Path:
        chain = published(self.directory)
        base = self.directory / BASE if chain else self.first_base
        number = int(chain[-1].name) + 1 if chain else int(base is not None)
        out, full = self.directory / f"{number:0{NAME_DIGITS}d}", self.directory / NEXT
        shutil.rmtree(full, ignore_errors=True)
        if base is None:
            export_checkpoint(self.run_dir, checkpoint, out)
            shutil.copytree(out, full)
        else:
            export_checkpoint(self.run_dir, checkpoint, out, base=base, keep_full=full)
        replace_directory(full, self.directory / BASE)
        log.info("published the model at step %d: %s (%s)", step, out, "a delta" if base else "a full export")
        return out
