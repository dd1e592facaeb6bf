"""Checkpoints through torch.distributed.checkpoint (DCP): every rank writes its own table shards.

A checkpoint is a directory: the DCP files of the sharded parts (``state_dict``: the
model, ``sparse_optimizer``: the embedding optimizers' state, in TorchRec's layout whichever
``sparse.backend`` trained, and, when the dense model is sharded too, ``optimizer_states``:
the dense optimizers' state, ``DENSE_OPTIMIZER_KEY``) plus ``meta.json`` / ``meta.safetensors`` (everything else
Lightning keeps: epoch, loops, callbacks, scheduler state, a replicated dense optimizer's
state; no pickle, see ``gr.train.checkpoint_meta``), written by rank 0 after every shard.
It is written under ``<name>.tmp`` and renamed when complete, so a directory holding
``meta.json`` is complete. Weights that are not all finite are refused before anything is
written (NonFiniteError). Checkpoints from before meta.json hold ``meta.pt``, read with
``torch.load(weights_only=True)``.
DCP reshards on load, so a checkpoint loads on any number of ranks, or into an unsharded
model in a plain process. DCP's own ``.metadata`` is torch's format (a pickle): a run
directory is trusted input.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, Sequence, Set

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from gr.train import checkpoint_meta
from gr.utils.atomic import replace_directory
from gr.utils.crash_points import crash_point
from gr.utils.finite import NonFiniteError, non_finite

SHARDED_KEYS = ("state_dict", "sparse_optimizer")
DENSE_OPTIMIZER_KEY = "optimizer_states"
META_FILE = checkpoint_meta.META_JSON
LEGACY_META_FILE = "meta.pt"
# What DCP says on every load without a process group, even one asked for with no_dist=True.
SINGLE_PROCESS_LOAD = r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load"


def save_checkpoint(checkpoint: Dict[str, Any], path: str | Path, sharded_keys: Sequence[str] = SHARDED_KEYS) -> None:
    """Write ``checkpoint`` (a Lightning checkpoint dict) to directory ``path``; call on every rank.

    sharded_keys: the entries every rank writes its part of through DCP; rank 0 writes the
    rest as meta.json (+ meta.safetensors)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    leader = _rank() == 0
    crash_point("checkpoint_before_save")
    _refuse_non_finite(checkpoint.get("state_dict", {}), path)
    if leader and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    dcp.save({k: checkpoint[k] for k in sharded_keys if k in checkpoint}, checkpoint_id=str(tmp))
    crash_point("checkpoint_mid_save")
    if leader:
        checkpoint_meta.write_meta({k: v for k, v in checkpoint.items() if k not in sharded_keys}, tmp)
        replace_directory(tmp, path)
    crash_point("checkpoint_after_save")
    _barrier()


def load_checkpoint(template: Dict[str, Any], path: str | Path, *, alone: bool = False) -> Dict[str, Any]:
    """Load directory ``path`` into ``template`` ({key: state dict to fill in place}) -> full checkpoint dict.
    alone: this process loads it by itself (a template of whole tensors), even when
    torch.distributed runs (rank 0 exporting while the other ranks wait); otherwise every rank loads."""
    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{path}: not a complete gr checkpoint directory (no {META_FILE})")
    try:
        with warnings.catch_warnings():  # a model loaded back in one process (export, evaluate) is meant to be
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS_LOAD, category=UserWarning)
            dcp.load(template, checkpoint_id=str(path), no_dist=alone or not dist.is_initialized())
    except CheckpointException as error:  # a BaseException: would escape every `except Exception`
        causes = "; ".join(f"rank {rank}: {_failure_text(cause)}" for rank, cause in sorted(error.failures.items()))
        raise ValueError(f"{path}: the checkpoint does not fit this model and config ({causes})") from error
    return {**read_meta(path), **template}


def model_keys(path: str | Path) -> Set[str]:
    """The model's state dict keys (``model.*``) checkpoint directory ``path`` holds, from DCP's
    metadata (no tensor is read)."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    prefix = "state_dict."
    return {key[len(prefix) :] for key in metadata.state_dict_metadata if key.startswith(prefix)}


def _failure_text(failure: Any) -> str:
    """One rank's DCP failure, an (exception, stack summary) pair, as ``Type: message`` on one line."""
    error = failure[0] if isinstance(failure, tuple) and failure else failure
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    return " ".join(text.split())


def is_complete(path: str | Path) -> bool:
    """Whether directory ``path`` holds a whole checkpoint (its metadata is written last)."""
    path = Path(path)
    return (path / META_FILE).is_file() or (path / LEGACY_META_FILE).is_file()


def read_meta(path: str | Path) -> Dict[str, Any]:
    """The non-sharded part of checkpoint directory ``path`` (epoch, callbacks, ...)."""
    path = Path(path)
    if (path / META_FILE).is_file():
        return checkpoint_meta.read_meta(path)
    try:
        return torch.load(path / LEGACY_META_FILE, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises UnpicklingError, RuntimeError, ... for refused content
        raise ValueError(
            f"{path / LEGACY_META_FILE}: refused (only plain tensors and containers load; "
            f"{type(error).__name__}: {error})"
        ) from error


def checkpoint_source(run_dir: Path, checkpoint: Path) -> Dict[str, Any]:
    """Where a model came from: {"run": the run directory (absolute), "checkpoint": ``checkpoint``
    relative to it, "epoch", "global_step"} (an export's source.json, a warm start's init_from)."""
    meta = read_meta(checkpoint)
    return {
        "run": str(run_dir.resolve()),
        "checkpoint": checkpoint.relative_to(run_dir).as_posix(),
        "epoch": meta.get("epoch"),
        "global_step": meta.get("global_step"),
    }


def logged_steps(path: str | Path) -> int:
    """The step the logs of a run resumed from checkpoint ``path`` continue at: Lightning's count of
    batches that stepped the optimizer (the logs' ``step``), else the checkpoint's global step."""
    meta = read_meta(path)
    epoch_loop = meta.get("loops", {}).get("fit_loop", {}).get("epoch_loop.state_dict", {})
    return int(epoch_loop.get("_batches_that_stepped", meta.get("global_step", 0)))


def _refuse_non_finite(state: Dict[str, Any], path: Path) -> None:
    """NonFiniteError on every rank when any rank's shard of ``state`` holds NaN or an infinity."""
    bad = non_finite(state.items())
    flag = torch.tensor([float(bool(bad))])
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if bool(flag.item()):
        names = ", ".join(bad[:5]) or "another rank's shards"
        raise NonFiniteError(f"{path}: not saved, the weights are not all finite ({names})")


def remove_checkpoint(path: str | Path) -> None:
    if _rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
