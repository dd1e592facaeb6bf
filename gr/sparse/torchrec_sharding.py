"""The TorchRec backend: sharding the tables over ranks with TorchRec's planner and DistributedModelParallel.

``shard_model`` does it all: it attaches each table's optimizer with
``apply_optimizer_in_backward`` (before sharding, as TorchRec requires), plans with
``EmbeddingShardingPlanner`` under per-table constraints (row-wise by default, fused
kernels), and wraps the model in ``DistributedModelParallel``: sharded tables plus DDP
over every dense parameter (none with one rank: there is nothing to all-reduce, and DDP's
per-parameter hooks cost about 1.5 % of a small training step).

Placement (``gr.sparse.sharding.table_device``): with ``"host"`` the tables (and their
optimizer state) live in host memory and talk over a gloo process group while the dense
model's DDP keeps the default one.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Set

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from gr.sparse.optimizer import EmbeddingOptimizerConfig
from gr.sparse.sharding import EMBEDDINGS_ATTR, table_device
from gr.sparse.tables import SparseEmbeddings
from gr.sparse.touched import Drain


def apply_embedding_optimizers(
    embeddings: SparseEmbeddings, default: EmbeddingOptimizerConfig, device_type: str
) -> Dict[str, EmbeddingOptimizerConfig]:
    """Attach each table's optimizer (its own or ``default``) to its weight, to run in backward.

    Returns {table name: optimizer config}. Raises when FBGEMM has no fused kernel
    for an optimizer on ``device_type``.
    """
    weights = _table_weights(embeddings)
    chosen = {}
    for name, table in embeddings.tables.items():
        optimizer = table.optimizer or default
        optimizer.check_device(
            device_type, f"model.tables[{name}].optimizer" if table.optimizer else "sparse.optimizer"
        )
        apply_optimizer_in_backward(optimizer.optimizer_class(), [weights[name]], optimizer.fused_kwargs())
        chosen[name] = optimizer
    return chosen


def plan_sharding(
    model: nn.Module, embeddings: SparseEmbeddings, device: torch.device, pg: dist.ProcessGroup
) -> ShardingPlan:
    """Rank 0 plans under each table's sharding type with fused kernels; every rank gets the plan."""
    for name, table in embeddings.tables.items():
        sharder = sharders()[0 if table.kind == "sequence" else 1]
        allowed = sharder.sharding_types(device.type)
        if table.sharding not in allowed:
            raise ValueError(
                f"model.tables[{name}].sharding: TorchRec shards {table.kind} tables on {device.type} as one of "
                f"{sorted(allowed)}, got {table.sharding!r}"
            )
    world_size = dist.get_world_size(pg)
    topology = TopologyFactory.create_topology(
        TrainerConfig(world_size=world_size, local_world_size=_local_world_size(world_size)),
        kernel_config=KernelConfig(compute_device=device.type),
    )
    constraints = {
        name: ParameterConstraints(sharding_types=[table.sharding], compute_kernels=["fused"])
        for name, table in embeddings.tables.items()
    }
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints, debug=False)
    return planner.collective_plan(model, sharders(), pg)


def shard_model(
    model: nn.Module,
    default_optimizer: EmbeddingOptimizerConfig,
    dense_device: torch.device,
    placement: str = "device",
    pg: Optional[dist.ProcessGroup] = None,
    dense_wrapper: Optional["DenseDataParallelWrapper"] = None,
) -> DistributedModelParallel:
    """Shard ``model.embeddings`` (a SparseEmbeddings) over the ranks of ``pg`` (default: WORLD).

    dense_wrapper: how the dense modules are spread over ranks (default: DDP over all of
    them, ``DenseDataParallelWrapper(dense_device, pg)``).

    The model must be built identically on every rank (same seed): EmbeddingCollection
    tables are copied into their shards, so the initial weights do not depend on the
    number of ranks. Call on every rank.
    """
    pg = pg or dist.group.WORLD
    assert pg is not None  # the default group is set once torch.distributed is initialised
    embeddings = getattr(model, EMBEDDINGS_ATTR, None)
    if not isinstance(embeddings, SparseEmbeddings) or embeddings.backend != "torchrec":
        raise ValueError(f"shard_model: expected the model's {EMBEDDINGS_ATTR!r} to be SparseEmbeddings of TorchRec")
    device = table_device(dense_device, placement)
    initial_bags = {name: bags.state_dict() for name, bags in embeddings.pooled_collections().items()}
    apply_embedding_optimizers(embeddings, default_optimizer, device.type)
    if device != dense_device:
        embeddings.output_device = dense_device
    # Host-memory tables exchange CPU tensors: their collectives need gloo, whatever the dense model uses.
    sparse_pg = dist.new_group(backend="gloo") if device.type == "cpu" and dist.get_backend(pg) != "gloo" else pg
    plan = plan_sharding(model, embeddings, device, sparse_pg)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(sparse_pg),
        device=device,
        plan=plan,
        sharders=sharders(),
        data_parallel_wrapper=dense_wrapper or DenseDataParallelWrapper(dense_device, pg),
    )
    sharded = dmp.module.embeddings.pooled_collections()
    for name, state in initial_bags.items():  # TorchRec copies EmbeddingCollection weights into shards, not bag weights
        sharded[name].load_state_dict(state)
    return dmp


def track_updated_rows(dmp: DistributedModelParallel) -> Drain:
    """Record the ids of each lookup of ``dmp``'s tables with TorchRec's ModelDeltaTracker -> a
    function returning {table: [n] int64 global row ids} of this rank's shards looked up since
    its last call (``gr.sparse.touched``). The tracker sees a shard's local ids: a row-wise
    shard's are moved by the shard's first row."""
    tracker = ModelDeltaTrackerTrec(dmp, delete_on_read=True)  # built here: DMP's own builder wants DDP around it
    rank = dist.get_rank(dmp._env.process_group) if dist.is_initialized() else 0
    first_rows = {}
    for tables in dmp.plan.plan.values():
        for name, sharding in tables.items():
            shards = sharding.sharding_spec.shards if sharding.sharding_spec is not None else []
            mine = [s.shard_offsets[0] for s in shards if s.placement is not None and s.placement.rank() == rank]
            first_rows[name] = mine[0] if mine else 0
    fqn_table = {fqn: name for name, fqn in tracker.table_to_fqn.items()}

    def drain() -> Dict[str, torch.Tensor]:
        if not any(tracker.store.per_fqn_lookups.values()):
            return {}
        ids = tracker.get_unique_ids()
        tracker.clear()
        tracker.step()
        return {fqn_table[fqn]: local + first_rows[fqn_table[fqn]] for fqn, local in ids.items()}

    return drain


def sharders() -> List:
    return [EmbeddingCollectionSharder(), EmbeddingBagCollectionSharder()]


class DenseDataParallelWrapper(DefaultDataParallelWrapper):
    """DDP over the dense modules, placed on ``dense_device``, over process group ``pg`` (with one
    rank, the modules unwrapped); sharded tables stay on their device."""

    def __init__(self, dense_device: torch.device, pg: dist.ProcessGroup) -> None:
        super().__init__()
        self.dense_device = dense_device
        self.pg = pg

    def _ddp_wrap(
        self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device, ddp_ignore_param_names: Set[str]
    ) -> None:
        module = dmp._dmp_wrapped_module
        for name, child in module.named_children():
            if name != EMBEDDINGS_ATTR:
                child.to(self.dense_device)
        if not set(dict(dmp.named_parameters())) - ddp_ignore_param_names:
            return
        if dist.get_world_size(self.pg) == 1:  # nothing to all-reduce: DDP's per-step hooks are pure overhead
            return
        # No buffer is ever synced: the sharded tables' buffers differ per rank and dense buffers
        # are equal by construction. Ignoring every buffer keeps that with ``forward_sync_buffers``
        # (which, unlike the deprecated ``broadcast_buffers=False``, syncs non-ignored buffers at init).
        ignored = set(ddp_ignore_param_names) | {name for name, _ in module.named_buffers()}
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored)
        dmp._dmp_wrapped_module = DistributedDataParallel(
            module,
            device_ids=None if self.dense_device.type == "cpu" else [self.dense_device],
            process_group=self.pg,
            gradient_as_bucket_view=True,
            forward_sync_buffers=False,
            static_graph=self._static_graph,
            find_unused_parameters=self._find_unused_parameters,
            bucket_cap_mb=self._bucket_cap_mb,
        )


def _table_weights(embeddings: SparseEmbeddings) -> Dict[str, nn.Parameter]:
    weights = {}
    collection: Any  # a TorchRec EmbeddingCollection (torch's stubs type ModuleDict items as nn.Module)
    for collection in embeddings.sequence.values():
        weights.update({name: module.weight for name, module in collection.embeddings.items()})
    bags: Any  # an EmbeddingBagCollection, likewise
    for bags in embeddings.pooled_collections().values():
        weights.update({name: module.weight for name, module in bags.embedding_bags.items()})
    return weights


def _local_world_size(world_size: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
