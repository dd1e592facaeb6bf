"""Where the tables live and how they are spread over ranks.

Placement: ``"device"`` keeps the tables where the dense model runs; ``"host"`` keeps them
(and their optimizer state) in host memory and runs the dense model on the accelerator,
moving looked-up vectors over. That is the plan for accelerators whose embedding kernels are
immature (NPUs).

Sharding is the TorchRec backend's (``gr.sparse.torchrec_sharding``: ``shard_model`` and
friends, importable from here and loaded on first use, so this module needs no TorchRec);
the torch backend keeps every table whole on its one rank (``check_one_rank``).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from gr.sparse.config import PLACEMENTS
from gr.utils.lazy import lazy_getattr

# The attribute of the wrapped model holding its SparseEmbeddings (GRModel.embeddings).
EMBEDDINGS_ATTR = "embeddings"

_TORCHREC = ("shard_model", "plan_sharding", "apply_embedding_optimizers", "sharders", "DenseDataParallelWrapper")
__getattr__ = lazy_getattr(__name__, {name: "gr.sparse.torchrec_sharding" for name in _TORCHREC})


def table_device(dense_device: torch.device, placement: str, backend: str = "torchrec") -> torch.device:
    """Where the tables live: host memory, or the dense model's device (for TorchRec, one it has kernels for)."""
    if placement not in PLACEMENTS:
        raise ValueError(f"sparse.placement: expected one of {list(PLACEMENTS)}, got {placement!r}")
    if placement == "host":
        return torch.device("cpu")
    if backend == "torchrec" and dense_device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"sparse.placement: TorchRec has no embedding kernels for {dense_device.type}; "
            "use placement: host (tables in host memory, dense model on the accelerator)"
        )
    return dense_device


def check_one_rank(backend: str, world_size: int) -> None:
    """ValueError unless ``backend`` can train on ``world_size`` ranks (only TorchRec shards tables)."""
    if backend != "torchrec" and world_size > 1:
        raise ValueError(
            f"sparse.backend: {backend!r} keeps every table whole on one rank, but this run has {world_size} "
            "ranks; use sparse.backend: torchrec (tables sharded over ranks) or run one process"
        )


def local_table_rows(model: nn.Module) -> Mapping[str, int]:
    """{table name: rows stored on this rank}, from the state dict of a DistributedModelParallel
    (its shards) or of a plain model (whole tables)."""
    rows = {}
    for key, value in model.state_dict().items():
        if key.startswith(f"{EMBEDDINGS_ATTR}.") and key.endswith(".weight"):
            table = key.split(".")[-2]
            shards = value.local_shards() if hasattr(value, "local_shards") else None
            rows[table] = int(value.shape[0]) if shards is None else sum(int(s.tensor.shape[0]) for s in shards)
    return rows
