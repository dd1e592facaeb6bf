"""``train``: one run from a TrainConfig into a run directory, and ``load_trained_model`` back out of it.

See ``gr.train`` for the run directory layout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from gr.data.datamodule import SequenceDataModule
from gr.data.features import FeatureSpec
from gr.data.mappings import IdMap, model_maps
from gr.data.popularity import POPULARITY_FILE, load_popularity, save_popularity
from gr.model import GRModel
from gr.sparse.sharding import local_table_rows
from gr.train import checkpoint as ckpt
from gr.train.build import EMPTY_HISTORY, build_model, build_tables, check_declared_features, without_empty_history
from gr.train.config import TrainConfig, load_config, plain, save_config
from gr.train.csv_log import AppendingCSVLogger, drop_rows_from_step
from gr.train.memory import check_memory_fits, plan_for_data
from gr.train.module import GRTrainingModule
from gr.train.npu import NPU_PROCESS_GROUP_BACKEND, npu_trainer_args
from gr.train.progress import progress_callbacks
from gr.train.run_files import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    FEATURES_FILE,
    INIT_FROM_FILE,
    LAST_CHECKPOINT,
    LOGS_DIR,
    MAPPINGS_DIR,
    METRICS_FILE,
)
from gr.train.strategy import TorchRecStrategy
from gr.train.warm_start import WarmStart, check_not_export
from gr.utils.atomic import replace_directory, write_json
from gr.utils.devices import check_accelerator, runs_on_cpu
from gr.utils.host import available_memory_bytes
from gr.utils.run_lock import run_lock, writes_run

log = logging.getLogger(__name__)


def train(
    config: TrainConfig, out_dir: str | Path, resume: bool = False, callbacks: Sequence[Callback] = ()
) -> Dict[str, Any]:
    """Train, validate every epoch, test the best checkpoint; returns what ``metrics.json`` holds.

    resume: continue from the run's newest complete checkpoint (``resume_checkpoint``; the
    same run, e.g. with a larger ``trainer.max_epochs``). The run directory's files
    (config.yaml, features.json, mappings) are written once training starts, after that
    checkpoint has loaded, so a resume that fails leaves the run as it was; logs append.

    callbacks: more Lightning callbacks, called after the run's own (the run's files are written
    by then): ``gr.export.publish.Publisher`` publishes as ``trainer.publish_every`` says
    (``gr train`` adds it; the training code itself writes no export).

    Refused before anything is written (ValueError, one line): an accelerator this host lacks,
    a run directory another process holds (``gr.utils.run_lock``; rank 0 takes it), and on CPU a
    model whose ``gr plan`` estimate exceeds the available memory (``trainer.memory_check``).
    """
    out_dir = Path(out_dir)
    check_accelerator(config.trainer.accelerator)
    command = "gr train --resume" if resume else "gr train"
    with run_lock(out_dir, command) if writes_run() else contextlib.nullcontext():
        return _train(config, out_dir, resume, callbacks)


class RunComplete(Exception):
    """``--resume`` of a run whose newest checkpoint already holds ``trainer.max_epochs`` epochs:
    there is nothing to train, and nothing is rewritten."""


def _train(config: TrainConfig, out_dir: Path, resume: bool, callbacks: Sequence[Callback]) -> Dict[str, Any]:
    config = config.self_contained()  # the run's config.yaml reads the same from any working directory
    start = resume_checkpoint(out_dir) if resume else None
    if start:
        _check_epochs_left(start, config.trainer.max_epochs)
        config = _as_checkpointed(config, start)
    if config.trainer.num_threads:
        torch.set_num_threads(config.trainer.num_threads)
    check_declared_features(config)
    warm_start = _warm_start(config) if config.trainer.init_from and not start else None
    base_maps = warm_start.maps if warm_start else None
    if start and config.trainer.init_from:  # a warm-started run resumes on the maps it grew
        base_maps = model_maps(str(out_dir / MAPPINGS_DIR))
    datamodule = SequenceDataModule(config.data, config.model.hstu.eviction_block, base_maps)
    datamodule.setup()
    init_from = _init_from(warm_start, datamodule.id_maps()) if warm_start else None
    spec = datamodule.feature_spec()
    tables = build_tables(config, spec, for_training=False)  # refuses tables that do not fit the data
    config = _with_resolved_tables(config, tables)
    if config.trainer.memory_check and runs_on_cpu(config.trainer.accelerator):
        local = _devices(config.trainer.devices)
        plan = plan_for_data(config, spec, datamodule.tasks, local * config.trainer.num_nodes)
        check_memory_fits(plan, config, local, available_memory_bytes())
    module = GRTrainingModule(
        config, spec, datamodule.tasks, datamodule.popularity(), warm_start, datamodule.item_features.columns()
    )

    resumed_step = ckpt.logged_steps(start) if start else None

    def write_run_files() -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        if resumed_step is not None:
            drop_rows_from_step(out_dir / LOGS_DIR / "metrics.csv", resumed_step)
        save_config(config, out_dir / CONFIG_FILE)
        write_json(out_dir / FEATURES_FILE, plain({"spec": vars(spec), "tasks": list(datamodule.tasks)}))
        datamodule.save_mappings(str(out_dir / MAPPINGS_DIR))
        save_popularity(out_dir / POPULARITY_FILE, datamodule.popularity().numpy())
        if init_from:
            write_json(out_dir / INIT_FROM_FILE, init_from)

    trainer, checkpoints = make_trainer(config, out_dir, [_OnTrainStart(write_run_files), *callbacks], resumed_step)
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(start) if start else None)
    test: Dict[str, float] = {}
    if config.data.validates:
        # No best checkpoint when validation never ran (check_val_every_n_epoch > max_epochs): test the last.
        best = "best" if checkpoints.best_model_path else str(out_dir / CHECKPOINTS_DIR / LAST_CHECKPOINT)
        trainer.test(module, datamodule=datamodule, ckpt_path=best, verbose=trainer.is_global_zero)
        test = module.last_metrics["test"]
    metrics = _metrics_json(config, test, checkpoints, trainer, out_dir, module, datamodule.summary)
    if trainer.is_global_zero:
        write_json(out_dir / METRICS_FILE, plain(metrics))
    return metrics


def _warm_start(config: TrainConfig) -> WarmStart:
    """The run ``trainer.init_from`` names, read after checking it builds the same model (no data read),
    under the run's lock, shared (``gr.utils.run_lock``): a run being trained or resumed is refused."""
    source = Path(config.trainer.init_from or "")
    check_not_export(source)
    if not source.is_dir():
        raise FileNotFoundError(f"trainer.init_from: {source}: no such run directory")
    with run_lock(source, "gr train --init-from", shared=True):
        return WarmStart.load(source, config, read_run(source), best_checkpoint(source), source / MAPPINGS_DIR)


def _init_from(warm_start: WarmStart, maps: Dict[str, IdMap]) -> Dict[str, Any]:
    """{the checkpoint's ``checkpoint_source``, "new_ids": {map: ids added}}, logged on one line."""
    origin = warm_start.origin
    new_ids = warm_start.new_ids(maps)
    log.info(
        "warm start from %s/%s (epoch %s, step %s); new ids: %s",
        origin["run"],
        origin["checkpoint"],
        origin["epoch"],
        origin["global_step"],
        ", ".join(f"{name} {count}" for name, count in new_ids.items()) or "none",
    )
    return {**origin, "new_ids": new_ids}


def _check_epochs_left(start: Path, max_epochs: int) -> None:
    """RunComplete when the checkpoint ``--resume`` starts from holds ``max_epochs`` epochs, a
    ValueError when it holds more (Lightning would fail deep inside its loop)."""
    done = int(ckpt.read_meta(start).get("epoch", -1)) + 1  # saved in its last epoch, counted from 0
    if done == max_epochs:
        raise RunComplete(
            f"run already at epoch {done} of {max_epochs} ({start}); raise --trainer.max_epochs to train more"
        )
    if done > max_epochs:
        raise ValueError(
            f"trainer.max_epochs: {max_epochs}, but the run to resume is already at epoch {done} ({start}); "
            f"expected at least {done}"
        )


class _OnTrainStart(Callback):
    """Calls ``action`` on rank 0 when training starts: after a resumed checkpoint has loaded."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action = action

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero:
            self.action()


class NewestAndBestCheckpoints(ModelCheckpoint):
    """The best epoch by the monitored metric (``epoch=N``) and the newest epoch (``last``), both DCP
    directories. Lightning 2.6 writes ``last`` only in a step that also saved a best checkpoint, so
    after an epoch that did not improve, ``last`` would stay at the best epoch and ``--resume``
    would train the later epochs again: ``last`` is written at the end of every training epoch."""

    CHECKPOINT_NAME_LAST = LAST_CHECKPOINT
    FILE_EXTENSION = ""  # checkpoints are directories

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if not self._should_skip_saving_checkpoint(trainer):  # skipped when this step saved already
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: Dict[str, Any]) -> None:
        """Flush the logs with every checkpoint, so a run killed later has logged every step its
        newest checkpoint holds (the CSV logger otherwise writes every 100 steps)."""
        for logger in trainer.loggers:
            logger.save()
        return super().on_save_checkpoint(trainer, pl_module, checkpoint)


def _after_event_files(out_dir: Path, resumed_step: Optional[int]) -> Optional[int]:
    """-> resumed_step, once a resumed run's TensorBoard file will sort after the interrupted run's.
    TensorBoard reads a directory's event files in name order and a purge applies to the files read
    before it; a name starts with the second its writer was made in (then host and pid), so within
    the newest existing file's second the new one could sort first: that second is waited out."""
    if resumed_step is not None:
        names = [p.name.split(".") for p in (out_dir / LOGS_DIR).glob("events.out.tfevents.*")]
        seconds = [int(parts[3]) for parts in names if parts[3].isdigit()]
        if seconds:
            time.sleep(max(0.0, max(seconds) + 1 - time.time()))
    return resumed_step


def make_trainer(
    config: TrainConfig, out_dir: Path, extra_callbacks: Sequence[Callback] = (), resumed_step: Optional[int] = None
) -> Tuple[Trainer, ModelCheckpoint]:
    """The Lightning Trainer of a run (TorchRec strategy, DCP checkpoints of the best and last
    epoch, optional early stopping, TensorBoard and appending CSV logs), and its checkpoint callback.
    resumed_step: the logs' step a resumed run continues at; TensorBoard hides what the interrupted
    run logged from there on (SummaryWriter's ``purge_step``), as the CSV log drops those rows."""
    t, validates = config.trainer, config.data.validates
    checkpoints = NewestAndBestCheckpoints(
        dirpath=out_dir / CHECKPOINTS_DIR,
        filename="epoch={epoch}",
        monitor=config.monitor if validates else None,
        mode=t.monitor_mode,
        save_top_k=1 if validates else 0,  # nothing validated: the last checkpoint is the run's
        save_last=True,
        auto_insert_metric_name=False,
    )
    progress = progress_callbacks(t.enable_progress_bar, t.log_every_n_steps, config.monitor if validates else None)
    callbacks = [checkpoints, *progress, *extra_callbacks]
    if t.early_stopping_patience:
        callbacks.append(EarlyStopping(config.monitor, patience=t.early_stopping_patience, mode=t.monitor_mode))
    device_args: Dict[str, Any] = dict(
        accelerator="cuda" if t.accelerator == "gpu" else t.accelerator, precision=t.precision
    )
    strategy = TorchRecStrategy()
    if t.accelerator == "npu":
        device_args = npu_trainer_args(t.precision)
        strategy = TorchRecStrategy(process_group_backend=NPU_PROCESS_GROUP_BACKEND)
    trainer = Trainer(
        strategy=strategy,
        **device_args,
        devices=_devices(t.devices),
        num_nodes=t.num_nodes,
        max_epochs=t.max_epochs,
        gradient_clip_val=t.gradient_clip_val or None,
        log_every_n_steps=t.log_every_n_steps,
        check_val_every_n_epoch=t.check_val_every_n_epoch,
        limit_val_batches=None if validates else 0,
        limit_train_batches=t.limit_train_batches,
        enable_progress_bar=t.enable_progress_bar,
        callbacks=callbacks,
        logger=[
            TensorBoardLogger(out_dir, name=LOGS_DIR, version="", purge_step=_after_event_files(out_dir, resumed_step)),
            AppendingCSVLogger(out_dir, name=LOGS_DIR, version=""),
        ],
        use_distributed_sampler=False,  # the data module deals batches to ranks itself
        num_sanity_val_steps=0,
    )
    return trainer, checkpoints


def _metrics_json(
    config: TrainConfig,
    test: Dict[str, float],
    checkpoints: ModelCheckpoint,
    trainer: Trainer,
    out_dir: Path,
    module: GRTrainingModule,
    data: Dict[str, Any],
) -> Dict[str, Any]:
    """{metric: test value, "popularity": {...}, "best_val": ..., ..., "data": the data module's
    summary (rows read, duplicates dropped or kept, ...), "config": {...}}."""
    metrics: Dict[str, Any] = {k: v for k, v in test.items() if not k.startswith("popularity/")}
    baseline = {k.split("/", 1)[1]: v for k, v in test.items() if k.startswith("popularity/")}
    if baseline:
        metrics["popularity"] = baseline
    rows = local_table_rows(module.model)
    per_rank: List[Any] = [rows]  # every rank's, once gathered
    if dist.is_initialized() and dist.get_world_size() > 1:
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, rows)
    best = Path(checkpoints.best_model_path or checkpoints.last_model_path)
    score = checkpoints.best_model_score
    metrics.update(
        {
            "best_val": {config.monitor: None if score is None else float(score)},
            "best_checkpoint": str(best.relative_to(out_dir.resolve())),
            "epochs": trainer.current_epoch,
            "world_size": trainer.world_size,
            "table_rows_per_rank": {table: [r[table] for r in per_rank] for table in rows},
            "data": data,
            "config": config.to_dict(),
        }
    )
    if (out_dir / INIT_FROM_FILE).is_file():  # written when the warm start began, kept through resumes
        metrics["init_from"] = json.loads((out_dir / INIT_FROM_FILE).read_text())
    return metrics


def _as_checkpointed(config: TrainConfig, start: Path) -> TrainConfig:
    """``config`` for resuming from checkpoint ``start``: a run whose checkpoint has no
    ``empty_history`` (trained before it existed) goes on without the new-user query."""
    if EMPTY_HISTORY in {k.removeprefix("model.") for k in ckpt.model_keys(start)}:
        return config
    retrieval = replace(config.task.retrieval, new_user_query=False)
    return replace(config, task=replace(config.task, retrieval=retrieval))


def _devices(devices: Any) -> int:
    if devices != "auto":
        return devices
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def _with_resolved_tables(config: TrainConfig, tables: list) -> TrainConfig:
    """The config as actually used: table rows filled in from the data."""
    model = replace(config.model, tables=tuple(t.to_dict() for t in tables))
    return replace(config, model=model)


# ---- reading a run back -----------------------------------------------------------------------
def read_run(run_dir: str | Path) -> Tuple[TrainConfig, FeatureSpec, Tuple[str, ...]]:
    """The config, feature spec and ranking tasks a run was trained with (no data read)."""
    run_dir = Path(run_dir)
    config = load_config(run_dir / CONFIG_FILE)
    try:
        features = json.loads((run_dir / FEATURES_FILE).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{run_dir / FEATURES_FILE}: cannot read the run's feature spec ({error})") from error
    return config, FeatureSpec(**features["spec"]), tuple(features["tasks"])


def complete_checkpoints(run_dir: str | Path) -> List[Tuple[Path, Dict[str, Any]]]:
    """[(checkpoint directory, its metadata), ...] of the run's complete checkpoints, newest
    (most training steps) first; at equal steps ``last`` first. Read only."""
    found = []
    folder = Path(run_dir) / CHECKPOINTS_DIR
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if path.is_dir() and ckpt.is_complete(path):
            meta = ckpt.read_meta(path)
            found.append((path, meta))
    return sorted(found, key=lambda pm: (-int(pm[1].get("global_step", 0)), pm[0].name != LAST_CHECKPOINT))


def resume_checkpoint(run_dir: str | Path) -> Path:
    """The checkpoint ``--resume`` continues from: the newest complete one.

    First recovers ``last`` from a crash mid-replace: a complete ``last.tmp`` newer than
    ``last`` (or with no ``last``) becomes ``last``, else a lone ``last.old`` does. A crash
    while ``last.tmp`` was written leaves ``last`` older than the best checkpoint saved just
    before it, and that best checkpoint is then the newest."""
    folder = Path(run_dir) / CHECKPOINTS_DIR
    last, tmp, old = (folder / f"{LAST_CHECKPOINT}{suffix}" for suffix in ("", ".tmp", ".old"))
    steps = {path: int(meta.get("global_step", 0)) for path, meta in complete_checkpoints(run_dir)}
    if tmp in steps and steps[tmp] > steps.get(last, -1):
        replace_directory(tmp, last)
    elif last not in steps and old in steps:
        os.rename(old, last)
    found = complete_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(
            f"--resume {run_dir}: no checkpoint to resume from in {folder} "
            f"(none complete; did the run finish an epoch?)"
        )
    return found[0][0]


def best_checkpoint(run_dir: str | Path) -> Path:
    """The best checkpoint directory of a run: as the newest complete checkpoint whose recorded
    best still exists records it, else the newest complete checkpoint. Read only."""
    run_dir = Path(run_dir)
    found = complete_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(
            f"{run_dir}: no complete checkpoint in {run_dir / CHECKPOINTS_DIR} (did the run finish an epoch?)"
        )
    for path, meta in found:
        # The checkpoint callback's state (its key names its class: NewestAndBestCheckpoints{...}).
        states = meta.get("callbacks", {}).values()
        best: Optional[str] = next((s["best_model_path"] for s in states if "best_model_path" in s), None)
        if best and ckpt.is_complete(path.parent / Path(best).name):
            return path.parent / Path(best).name
    return found[0][0]


def run_popularity(run_dir: str | Path) -> Optional[np.ndarray]:
    """[num_items] int64: the training counts a run wrote (``popularity.safetensors``), or None."""
    path = Path(run_dir) / POPULARITY_FILE
    return load_popularity(path) if path.is_file() else None


def load_trained_model(run_dir: str | Path, checkpoint: Optional[Path] = None) -> Tuple[GRModel, TrainConfig]:
    """The run's ``checkpoint`` (default: its best) as a plain unsharded GRModel (all shards merged,
    eval mode), and its config. An item tower (``model.item_tower``) comes back without its items'
    features, which are data, not weights: give them with ``model.item_tower.set_items`` (e.g. the
    run's data module's ``item_features.columns()``). A checkpoint without ``empty_history`` loads
    without it (``without_empty_history``)."""
    config, spec, tasks = read_run(run_dir)
    checkpoint = checkpoint or best_checkpoint(run_dir)
    keys = {k.removeprefix("model.") for k in ckpt.model_keys(checkpoint)}
    model = without_empty_history(build_model(config, spec, tasks, for_training=False), keys)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    ckpt.load_checkpoint({"state_dict": state}, checkpoint, alone=True)  # whole tensors: no rank needed
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    return model.eval(), config
