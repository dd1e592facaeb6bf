"""Training progress for logs that are not a terminal: one line per epoch instead of a
redrawn progress bar (which a file records as one ever-growing line)."""

from __future__ import annotations

import sys
import time
from typing import Any, Dict, List

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ProgressBar


class EpochLines(ProgressBar):
    """Prints ``epoch E/N: train/loss=… val/…=… (S s)`` on rank 0 after each training epoch
    (its validation included)."""

    def __init__(self) -> None:
        super().__init__()
        self._enabled = True
        self._started = 0.0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A run resumed from a checkpoint saved inside an epoch finishes that epoch without
        # on_train_epoch_start: its time counts from here, never from an earlier process.
        self._started = time.perf_counter()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started = time.perf_counter()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not (self._enabled and trainer.is_global_zero):
            return
        shown = " ".join(
            f"{name}={value:.4f}"
            for name, value in sorted(_scalars(trainer.callback_metrics).items())
            if name.startswith(("train/loss", "val/"))
        )
        print(
            f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs}: {shown} "
            f"({time.perf_counter() - self._started:.1f}s)",
            file=sys.stdout,
            flush=True,
        )


def _scalars(metrics: Dict[str, Any]) -> Dict[str, float]:
    return {name: float(value) for name, value in metrics.items() if getattr(value, "numel", lambda: 1)() == 1}


def progress_callbacks(enabled: bool) -> List[Callback]:
    """The progress display of a run: Lightning's bar on a terminal, EpochLines otherwise."""
    return [EpochLines()] if enabled and not sys.stdout.isatty() else []
