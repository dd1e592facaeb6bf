"""Warm start: a new run that begins from a trained run's model, on new data.

``gr train --config C --init-from RUN`` (``trainer.init_from``):
* before any data is read, the model sections must agree: HSTU, tables (all but their rows),
  modules and model class, task type; the first key that differs is one line; and each of the
  run's id maps must be the one its checkpoint was trained with (``check_maps``);
* the new data's id maps extend the run's (``IdMap.extended``): every raw id the run knew keeps
  its dense id, so its table row; new ids are appended;
* tables: the run's rows are copied into the first rows of each (larger) new table, bit for
  bit; new rows keep their fresh initialisation (``init_std``, as the config says);
* ``warm_start.shrink`` below 1 starts each carried weight, dense parameters and the run's table rows
  alike, at shrink x the run's value + (1 - shrink) x the new run's fresh initialisation (Ash and
  Adams' "shrink and perturb", the perturbation being the fresh model; 1, the default: none);
* dense parameters (PrefixDNN, HSTU, PostfixDNN, the item tower, the new-user state
  ``empty_history``) are the run's; the item tower's bags (``model.item_tower``) grow with their
  features' tables, their new rows starting at zero; a run without ``empty_history``
  (``task.retrieval.new_user_query``) gives none: it starts fresh;
* the tables' optimizer state (e.g. RowWiseAdagrad's per-row sums) is carried for the run's
  rows and starts at zero for new rows (``warm_start.table_optimizer_state: carry``; ``reset``, the
  recipe's default: zero for every row); the dense optimizer's state (Adam's moments and step count, so its bias
  correction) starts fresh (``warm_start.dense_optimizer_state: fresh``) or is the run's
  (``carry``: a parameter grown by new ids, an item tower's bag, has zero state in its new rows);
  the learning-rate schedule begins again either way.
An export is not a source: it holds the user's modules as ONNX graphs, not trainable weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Sequence, Tuple

import torch
from torch import Tensor

from gr.data.features import ITEM_ID, FeatureSpec
from gr.data.mappings import IdMap, model_maps
from gr.model import GRModel
from gr.sparse.tables import TableConfig
from gr.sparse.torch_tables import attach_optimizers
from gr.train import checkpoint as ckpt
from gr.train.build import EMPTY_HISTORY, build_model, build_tables, without_empty_history
from gr.train.config import TrainConfig

TOWER_PREFIX = "item_tower."  # the item tower's parameters in a GRModel's state dict


@dataclass
class WarmStart:
    """What a new run takes from a trained one: where it comes from (the run and checkpoint, with its
    epoch and step: ``checkpoint.checkpoint_source``), its model (unsharded, torch tables), its id
    maps ({"items"|feature: IdMap}) and its tables' optimizer state (TorchRec's layout), and whether
    that state is carried ("carry") or every row's starts at zero ("reset": ``warm_start.table_optimizer_state``);
    the dense optimizer's state to carry ({dense parameter's name: its state}; empty: it starts
    fresh, ``warm_start.dense_optimizer_state``); the share of each carried weight kept
    (``warm_start.shrink``, the rest the fresh initialisation)."""

    origin: Dict[str, Any]
    model: GRModel
    maps: Dict[str, IdMap]
    table_optimizer_state: Dict[str, Any]
    table_state_policy: str = "carry"
    dense_optimizer_state: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    shrink: float = 1.0

    @classmethod
    def load(
        cls,
        source: Path,
        config: TrainConfig,
        run: Tuple[TrainConfig, FeatureSpec, Tuple[str, ...]],
        checkpoint: Path,
        mappings: Path,
    ) -> "WarmStart":
        """Run ``source`` (its config, spec and tasks: ``run``; its best ``checkpoint``; its
        ``mappings`` directory), after checking that ``config`` builds the same model (ValueError
        naming the first differing key otherwise) and that the maps fit the checkpoint
        (``check_maps``), and that a carried dense optimizer state can be (``check_dense_state``).
        Reads no data."""
        old_config, spec, tasks = run
        check_same_model(config, old_config, source)
        check_dense_state(config, old_config, source)
        model = build_model(old_config, spec, tasks, for_training=False)  # refuses a spec its tables do not hold
        without_empty_history(model, {k.removeprefix("model.") for k in ckpt.model_keys(checkpoint)})
        maps = model_maps(str(mappings))
        check_maps(maps, spec, build_tables(old_config, spec, for_training=False), checkpoint)
        optimizers = attach_optimizers(model, old_config.sparse.optimizer)
        template = {
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "sparse_optimizer": optimizers.state_dict(),
        }
        state = ckpt.load_checkpoint(template, checkpoint)
        model.load_state_dict({k.removeprefix("model."): v for k, v in state["state_dict"].items()})
        policy = config.warm_start.table_optimizer_state
        dense = {}
        if config.warm_start.dense_optimizer_state == "carry":
            dense = _named_dense_state(model, state.get(ckpt.DENSE_OPTIMIZER_KEY), checkpoint)
        origin = ckpt.checkpoint_source(source, checkpoint)
        return cls(origin, model, maps, state["sparse_optimizer"], policy, dense, config.warm_start.shrink)

    def new_ids(self, maps: Mapping[str, IdMap]) -> Dict[str, int]:
        """{map: how many ids ``maps`` (the new data's, extending the run's) add to the run's}."""
        return {name: maps[name].cardinality - old.cardinality for name, old in self.maps.items() if name in maps}

    @torch.no_grad()
    def copy_weights(self, model: GRModel) -> None:
        """Into ``model`` (freshly built, unsharded, tables at least as large): the run's dense
        parameters, and its table rows into each table's first rows (an item tower's bag: the
        rest zero), each floating-point weight shrunk towards its fresh value (``shrink``). An
        ``empty_history`` the run lacks keeps its fresh initialisation."""
        old = self.model.state_dict()
        for name, value in model.state_dict().items():
            if name == EMPTY_HISTORY and name not in old:
                continue
            source = old[name]
            if source.shape == value.shape:
                self._carry(value, source)
            else:  # a table, or an item tower's bag, grown by new ids
                self._carry(value[: source.shape[0]], source)
                if name.startswith(TOWER_PREFIX):  # a new feature value starts with no say in the item vector
                    value[source.shape[0] :].zero_()

    def _carry(self, fresh: Tensor, source: Tensor) -> None:
        """fresh <- source (shrink 1, or not floating point: bit for bit), else
        shrink * source + (1 - shrink) * fresh, in place."""
        if self.shrink == 1.0 or not fresh.is_floating_point():
            fresh.copy_(source)
        else:
            fresh.mul_(1.0 - self.shrink).add_(source, alpha=self.shrink)

    @torch.no_grad()
    def copy_table_optimizer_state(self, table_optimizers: Any) -> None:
        """The run's per-row optimizer state into the first rows of ``table_optimizers``' state
        (gr's TableOptimizers or TorchRec's fused optimizer, sharded tensors included); nothing
        under the "reset" policy, which leaves the fresh optimizers' zeros."""
        if self.table_state_policy == "reset":
            return
        state = table_optimizers.state_dict()
        for target, source in _paired_tensors(state["state"], self.table_optimizer_state["state"]):
            for rows, local in _local_rows(target):
                end = min(rows.stop, source.shape[0])
                if end > rows.start:
                    local[: end - rows.start].copy_(source[rows.start : end])
        table_optimizers.load_state_dict(state)

    @torch.no_grad()
    def copy_dense_optimizer_state(
        self, optimizer: torch.optim.Optimizer, parameters: Sequence[Tuple[str, Tensor]]
    ) -> None:
        """Into ``optimizer`` (fresh, stepping ``parameters``: (GRModel name, parameter) in its order):
        the run's state of each parameter it had, rows grown by new ids at zero; its learning rates
        and other hyperparameters stay the new run's. Nothing when the state starts fresh."""
        if not self.dense_optimizer_state:
            return
        state = optimizer.state_dict()
        for index, (name, parameter) in enumerate(parameters):
            old = self.dense_optimizer_state.get(name)
            if old is not None:
                state["state"][index] = {key: _grown(value, parameter, name) for key, value in old.items()}
        optimizer.load_state_dict(state)


def check_dense_state(config: TrainConfig, old: TrainConfig, source: Path) -> None:
    """ValueError naming the key unless ``config``'s dense optimizer can take run ``source``'s state
    (``warm_start.dense_optimizer_state: carry``): the same optimizer.type, and both dense models
    replicated (``distributed.dense_sharding: none``, whose state the checkpoint keeps whole)."""
    if config.warm_start.dense_optimizer_state != "carry":
        return
    carry = "warm_start.dense_optimizer_state carry"
    if config.optimizer.type != old.optimizer.type:
        raise ValueError(
            f"optimizer.type: {config.optimizer.type!r} here, {old.optimizer.type!r} in {source}; {carry} needs "
            "the run's optimizer (or warm_start.dense_optimizer_state fresh)"
        )
    for name, sharding in (
        ("here", config.distributed.dense_sharding),
        (f"in {source}", old.distributed.dense_sharding),
    ):
        if sharding != "none":
            raise ValueError(
                f"distributed.dense_sharding: {sharding!r} {name}; {carry} needs a replicated dense model ('none') "
                "in both runs (or warm_start.dense_optimizer_state fresh)"
            )


def _named_dense_state(model: GRModel, saved: Any, checkpoint: Path) -> Dict[str, Dict[str, Any]]:
    """{dense parameter's name: its state} of a checkpoint's replicated dense optimizer (``saved``:
    Lightning's list of optimizer state dicts, which number the parameters in the order the training
    module gives them: the GRModel's, tables left out)."""
    if not saved or "state" not in saved[0]:
        raise ValueError(f"{checkpoint}: holds no dense optimizer state to carry (warm_start.dense_optimizer_state)")
    tables = {id(p) for p in model.embeddings.parameters()} if model.embeddings is not None else set()
    names = [name for name, p in model.named_parameters() if id(p) not in tables and p.requires_grad]
    (group,) = saved[0]["param_groups"]
    if len(group["params"]) != len(names):
        raise ValueError(
            f"{checkpoint}: the dense optimizer steps {len(group['params'])} parameters, the model has "
            f"{len(names)}; the checkpoint is not this model's"
        )
    by_index = dict(zip(group["params"], names))
    return {by_index[index]: entry for index, entry in saved[0]["state"].items()}


def _grown(value: Any, parameter: Tensor, name: str) -> Any:
    """A parameter's saved state entry for ``parameter``: as it is, or (a parameter grown by new ids)
    in its first rows, the rest zero."""
    if not isinstance(value, Tensor) or value.dim() == 0 or value.shape == parameter.shape:
        return value
    if value.shape[1:] != parameter.shape[1:] or value.shape[0] > parameter.shape[0]:
        raise ValueError(
            f"{name}: dense optimizer state of shape {list(value.shape)}, parameter {list(parameter.shape)}"
        )
    grown = torch.zeros(parameter.shape, dtype=value.dtype)
    grown[: value.shape[0]] = value
    return grown


def check_not_export(source: Path) -> None:
    """ValueError unless ``source`` is not an export (warm start reads a run directory)."""
    if (source / "MANIFEST").is_file():
        raise ValueError(
            f"trainer.init_from: {source} is an export; warm start reads a run directory (an export holds "
            "the PrefixDNN/PostfixDNN as ONNX graphs, not trainable weights)"
        )


def check_same_model(config: TrainConfig, old: TrainConfig, source: Path) -> None:
    """ValueError naming the first model key where ``config`` and run ``source``'s config differ
    (tables compared without their rows, which grow with the data)."""
    if config.task_type != old.task_type:
        raise ValueError(f"data.task: {config.task_type!r} here, {old.task_type!r} in {source} (--init-from)")
    new, before = config.model.to_dict(), old.model.to_dict()
    for values in (new, before):
        values.pop("code_path")
        values["tables"] = [
            {k: v for k, v in TableConfig.from_dict(t, "model.tables").to_dict().items() if k != "num_embeddings"}
            for t in values["tables"]
        ]
    for key, here, there in _differences(new, before, "model"):
        raise ValueError(
            f"{key}: {here!r} here, {there!r} in {source}; --init-from needs the model of the run it starts from"
        )


def check_maps(maps: Mapping[str, IdMap], spec: FeatureSpec, tables: Sequence[TableConfig], checkpoint: Path) -> None:
    """ValueError in one line naming the map's file unless each of ``maps`` (a run's, by name:
    "items" or a side feature) is the map ``checkpoint`` was trained with: the map of a feature of
    the run's ``spec`` (whose ``tables`` hold at least its cardinality), of that feature's kind of
    ids (items from dense id 0, a side feature's values from 1, 0 being "unknown"), and as many
    ids as the run trained (the spec's cardinality). A map that repeats a raw id is refused as it
    is read (``load_mappings``)."""
    cardinalities = {**spec.sequence, **spec.common, **spec.token_lists}
    table_of = {feature: table for table in tables for feature in table.features}
    for name, id_map in maps.items():
        feature = ITEM_ID if name == "items" else name
        where = id_map.source or name
        if feature not in cardinalities:
            raise ValueError(
                f"{where}: map {name!r} is of no feature of the model in {checkpoint} (its features: "
                f"{sorted(cardinalities)})"
            )
        ids, offset = ("item ids", 0) if feature == ITEM_ID else (f"{feature!r} values", 1)
        if id_map.offset != offset:
            raise ValueError(f"{where}: dense ids from {id_map.offset}, but {ids} take dense ids from {offset}")
        trained, table = cardinalities[feature], table_of[feature]
        if id_map.cardinality != trained:
            raise ValueError(
                f"{where}: {len(id_map.raw)} {ids}, but {checkpoint} was trained with {trained - offset} (table "
                f"{table.name!r}: {table.num_embeddings} rows); the map is not the one the checkpoint was trained with"
            )


def _differences(a: Any, b: Any, where: str) -> Iterator[Tuple[str, Any, Any]]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b)):
            yield from _differences(a.get(key), b.get(key), f"{where}.{key}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _differences(x, y, f"{where}[{i}]")
    elif a != b:
        yield where, a, b


def _paired_tensors(new: Mapping[str, Any], old: Mapping[str, Any]) -> Iterator[Tuple[Any, Tensor]]:
    """(new state tensor, the run's) of each per-row state entry both optimizers hold."""
    for weight, entries in new.items():
        for key, target in entries.items():
            source = old.get(weight, {}).get(key)
            if isinstance(source, Tensor) and source.dim() > 0:
                yield target, source


def _local_rows(target: Any) -> Iterator[Tuple[range, Tensor]]:
    """(global rows, local tensor) of each piece of ``target`` this rank holds: a plain tensor is
    one piece; a TorchRec ShardedTensor its local shards."""
    if isinstance(target, Tensor) and not hasattr(target, "local_shards"):
        yield range(0, target.shape[0]), target
        return
    for shard in target.local_shards():
        start, size = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
        if len(shard.metadata.shard_offsets) > 1 and shard.metadata.shard_offsets[1] != 0:
            raise ValueError("--init-from: column-wise sharded table optimizer state is not supported")
        yield range(start, start + size), shard.tensor
