"""Training progress you can watch: Lightning's bar on a terminal, lines in a log that is not one,
and the step's throughput and learning rate in the logged metrics (TensorBoard and CSV).

Both count epochs from 1 (``epoch 3/8`` is the third of eight); checkpoint directory names keep
Lightning's count from 0 (``checkpoints/epoch=2`` holds the third), so that existing runs resume,
warm-start and export as before.

* ``Throughput`` logs ``train/samples_per_s`` and ``train/tokens_per_s`` (the epoch's so far, data
  loading included) and ``train/lr`` (the dense optimizer's) every logged step; the bar shows them.
* On a terminal, ``TerminalBar``: Lightning's TQDM bar (``Epoch E/N``, step/total, elapsed, ETA,
  loss, the latest validation metrics, samples/s), drawn at ``FALLBACK_COLUMNS`` where the terminal
  reports no width (a pty without a size, as ``script`` or a CI runner opens), where tqdm would
  draw nothing.
* Elsewhere, ``ProgressLines``: a line every ``trainer.log_every_n_steps`` steps with loss,
  throughput and ETA, and one per epoch with its validation metrics; a file records each once
  instead of one ever-growing redrawn line.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, List, Optional

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ProgressBar, TQDMProgressBar

FALLBACK_COLUMNS, FALLBACK_ROWS = 120, 24
SAMPLES, TOKENS, LR = "train/samples_per_s", "train/tokens_per_s", "train/lr"
SHORT_NAMES = {"train/loss": "loss", SAMPLES: "samples/s", TOKENS: "tokens/s"}


class Throughput(Callback):
    """Logs the epoch's samples/s and tokens/s so far (``seq_offsets``: sequences and tokens of each
    batch, timed from the epoch's start, so data loading counts) and the dense learning rate."""

    def __init__(self) -> None:
        self._started = 0.0
        self._samples = self._tokens = 0

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started, self._samples, self._tokens = time.perf_counter(), 0, 0

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._samples += int(batch.seq_offsets.numel() - 1)
        self._tokens += int(batch.seq_offsets[-1])
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        pl_module.log(SAMPLES, self._samples / elapsed, prog_bar=True, on_step=True, on_epoch=False)
        pl_module.log(TOKENS, self._tokens / elapsed, prog_bar=True, on_step=True, on_epoch=False)
        if trainer.optimizers:
            pl_module.log(LR, float(trainer.optimizers[0].param_groups[0]["lr"]), on_step=True, on_epoch=False)


class TerminalBar(TQDMProgressBar):
    """Lightning's TQDM bar, ``Epoch E/N`` counted from 1, at ``FALLBACK_COLUMNS`` where the terminal
    reports zero columns. monitor: the validation metric shown first (``trainer.monitor``), then
    the throughput and the other validation metrics: a narrow terminal cuts the end of the line."""

    def __init__(self, monitor: Optional[str] = None) -> None:
        super().__init__()
        self.monitor = monitor

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> Dict[str, Any]:
        """loss, the monitored metric, samples/s, tokens/s, then the other validation metrics (the
        latest validation's, from its end on)."""
        shown = {SHORT_NAMES.get(name, name): value for name, value in super().get_metrics(trainer, pl_module).items()}
        validation = _validation(trainer.callback_metrics)
        first = {"loss": shown.pop("loss")} if "loss" in shown else {}
        if self.monitor in validation:
            first[self.monitor] = validation.pop(self.monitor)
        return {**first, **shown, **validation}

    def init_train_tqdm(self) -> Any:
        bar = super().init_train_tqdm()
        if _terminal_columns() == 0:
            bar.dynamic_ncols, bar.ncols, bar.nrows = False, FALLBACK_COLUMNS, FALLBACK_ROWS
        return bar

    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        """Lightning's reset of the bar, its description set first: it is never drawn counted from 0."""
        self.train_progress_bar.set_description(f"Epoch {_epoch(trainer)}", refresh=False)
        self.train_progress_bar.reset(total=_finite(self.total_train_batches))


class ProgressLines(ProgressBar):
    """On rank 0: ``epoch E/N step S/T: train/loss=… samples/s=… tokens/s=… (elapsed s, ETA s)``
    every ``every`` steps, and ``epoch E/N: train/loss=… val/…=… (S s)`` after each training
    epoch (its validation included)."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self.every = every
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

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        done, total = batch_idx + 1, _finite(self.total_train_batches)
        if not (self._enabled and trainer.is_global_zero) or done % self.every or done == total:
            return  # the last step's numbers come with the epoch line
        elapsed = time.perf_counter() - self._started
        eta = f", ETA {elapsed / done * (total - done):.1f}s" if total else ""
        metrics = _scalars(self.get_metrics(trainer, pl_module))
        parts = [f"train/loss={metrics['train/loss']:.4f}"] if "train/loss" in metrics else []
        parts += [f"{SHORT_NAMES[name]}={metrics[name]:.0f}" for name in (SAMPLES, TOKENS) if name in metrics]
        steps = f"{done}/{total}" if total else str(done)
        _print(f"epoch {_epoch(trainer)} step {steps}: {' '.join(parts)} ({elapsed:.1f}s{eta})")

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not (self._enabled and trainer.is_global_zero):
            return
        shown = " ".join(
            f"{name}={value:.4f}"
            for name, value in sorted(_scalars(trainer.callback_metrics).items())
            if name.startswith(("train/loss", "val/"))
        )
        _print(f"epoch {_epoch(trainer)}: {shown} ({time.perf_counter() - self._started:.1f}s)")


def _epoch(trainer: Trainer) -> str:
    """``E/N``: the epoch running, counted from 1, of ``trainer.max_epochs``."""
    return f"{trainer.current_epoch + 1}/{trainer.max_epochs}"


def _validation(metrics: Dict[str, Any]) -> Dict[str, float]:
    """The ``val/`` scalars of ``metrics``, by name."""
    return {name: value for name, value in sorted(_scalars(metrics).items()) if name.startswith("val/")}


def _print(line: str) -> None:
    print(line, file=sys.stdout, flush=True)


def _finite(count: float) -> Optional[int]:
    return int(count) if count not in (float("inf"), None) else None


def _terminal_columns() -> int:
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns
    except (OSError, ValueError):
        return 0


def _scalars(metrics: Dict[str, Any]) -> Dict[str, float]:
    return {name: float(value) for name, value in metrics.items() if getattr(value, "numel", lambda: 1)() == 1}


def progress_callbacks(enabled: bool, every: int, monitor: Optional[str] = None) -> List[Callback]:
    """The progress display of a run (``TerminalBar`` on a terminal, ``ProgressLines`` otherwise;
    none when ``trainer.enable_progress_bar`` is off) and the throughput it shows, which is logged
    either way. every: ``trainer.log_every_n_steps``; monitor: the validation metric the bar shows
    first (``trainer.monitor``; None when nothing is validated)."""
    display: List[Callback] = []
    if enabled:
        display = [TerminalBar(monitor) if sys.stdout.isatty() else ProgressLines(every)]
    return [Throughput(), *display]
