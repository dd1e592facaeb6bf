"""Sharding the HSTU stack over ranks with FSDP2 (``fully_shard``), next to TorchRec's sharded tables.

``DistributedModelParallel`` shards the tables and hands the dense modules to a
data-parallel wrapper. ``FSDP2DenseWrapper`` is that wrapper for
``distributed.dense_sharding: fsdp2``: each HSTU layer becomes one FSDP2 unit (its
parameters all-gathered just before the layer runs and freed after, gradients
reduce-scattered), the stack's own parameters (position embedding) a last unit; the
PrefixDNN and PostfixDNN stay replicated under DDP, which ignores the sharded parameters.
Parameter names do not change, so DCP checkpoints hold the same keys as without FSDP.

Gloo implements the two collectives FSDP2 needs (``all_gather_into_tensor`` and
``reduce_scatter_tensor``), so this runs on CPU ranks as it does on GPUs with NCCL.
"""

from __future__ import annotations

from typing import Set

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv

from gr.hstu.stack import HSTU
from gr.sparse.sharding import DenseDataParallelWrapper

# The attribute of the wrapped model holding its HSTU stack (GRModel.hstu).
HSTU_ATTR = "hstu"


class FSDP2DenseWrapper(DenseDataParallelWrapper):
    """FSDP2 over the HSTU stack (one unit per layer) on ``dense_device``, across the ranks of
    ``pg``; DDP over the remaining dense modules."""

    def _ddp_wrap(
        self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device, ddp_ignore_param_names: Set[str]
    ) -> None:
        model = dmp._dmp_wrapped_module
        hstu = getattr(model, HSTU_ATTR).to(self.dense_device)
        shard_hstu(hstu, DeviceMesh.from_group(self.pg, self.dense_device.type))
        sharded = {f"{HSTU_ATTR}.{name}" for name, _ in hstu.named_parameters()}
        super()._ddp_wrap(dmp, env, device, ddp_ignore_param_names | sharded)


def shard_hstu(hstu: HSTU, mesh: DeviceMesh) -> None:
    """fully_shard each layer of ``hstu``, then the stack (its remaining parameters), over ``mesh``."""
    for layer in hstu.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(hstu, mesh=mesh)
