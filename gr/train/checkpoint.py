"""Checkpoints through torch.distributed.checkpoint (DCP): every rank writes its own table shards.

A checkpoint is a directory: the DCP files of the sharded parts (``state_dict``: the
model, ``sparse_optimizer``: the fused embedding optimizers' state, and, when the dense
model is sharded too, ``optimizer_states``: the dense optimizers' state,
``DENSE_OPTIMIZER_KEY``) plus ``meta.pt`` (everything else Lightning keeps: epoch, loops,
callbacks, scheduler state, a replicated dense optimizer's state), written by rank 0. It
is written under ``<name>.tmp`` and renamed when complete.
DCP reshards on load, so a checkpoint loads on any number of ranks, or into an unsharded
model in a plain process.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Dict, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from gr.atomic import replace_directory

SHARDED_KEYS = ("state_dict", "sparse_optimizer")
DENSE_OPTIMIZER_KEY = "optimizer_states"
META_FILE = "meta.pt"


def save_checkpoint(checkpoint: Dict[str, Any], path: str | Path, sharded_keys: Sequence[str] = SHARDED_KEYS) -> None:
    """Write ``checkpoint`` (a Lightning checkpoint dict) to directory ``path``; call on every rank.

    sharded_keys: the entries every rank writes its part of through DCP; rank 0 pickles the rest."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    leader = _rank() == 0
    if leader and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    dcp.save({k: checkpoint[k] for k in sharded_keys if k in checkpoint}, checkpoint_id=str(tmp))
    if leader:
        torch.save({k: v for k, v in checkpoint.items() if k not in sharded_keys}, tmp / META_FILE)
        replace_directory(tmp, path)
    _barrier()


def load_checkpoint(template: Dict[str, Any], path: str | Path) -> Dict[str, Any]:
    """Load directory ``path`` into ``template`` ({key: state dict to fill in place}) -> full checkpoint dict."""
    path = Path(path)
    if not (path / META_FILE).is_file():
        raise FileNotFoundError(f"{path}: not a gr checkpoint directory (no {META_FILE})")
    dcp.load(template, checkpoint_id=str(path))
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    return {**meta, **template}


def read_meta(path: str | Path) -> Dict[str, Any]:
    """The non-sharded part of checkpoint directory ``path`` (epoch, callbacks, ...)."""
    return torch.load(Path(path) / META_FILE, map_location="cpu", weights_only=False)


def remove_checkpoint(path: str | Path) -> None:
    if _rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
