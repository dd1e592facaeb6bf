"""Building a GRModel from a TrainConfig and what the data provides.

Tables come from ``model.tables`` (``num_embeddings: null`` -> the data's cardinality).
For retrieval, the item table also reads ``SAMPLED_ITEMS``: the positives and sampled
negatives of the sampled softmax, looked up through the same (sharded) table.

The model is ``model.class`` (a GRModel subclass; default GRModel) built as
``cls(hstu config, prefix_dnn, postfix_dnn, tables)``.

PrefixDNN / PostfixDNN classes come from ``model.prefix_dnn`` / ``model.postfix_dnn``
(``class`` import path + ``kwargs``). Constructor arguments the config leaves out are
filled when the constructor has them:
  hidden_dim     model.hstu.hidden_dim
  feature_dims   {token feature: dim}: every sequence id feature and token list feature
                 (its table's dim) and token dense feature of the data
  common_dims    {common feature: dim}: every per-request id feature and dense feature
  embedding_dim  the item table's dim (retrieval)
  tasks          the data's ranking task names
A list of feature names given for ``feature_dims`` / ``common_dims`` selects those
features (with their dims).

``model.item_tower`` (retrieval) adds ``GRModel.item_tower`` (``gr.postfix_dnn.item_tower``):
each named item feature's bag has its table's rows and dim; a dense one is read as it is.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Collection, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from gr.data.declared import declared_spec
from gr.data.features import ITEM_ID, FeatureSpec
from gr.model import GRModel
from gr.postfix_dnn import PostfixDNN
from gr.postfix_dnn.item_tower import POPULARITY_FEATURE, ItemEncoder, ItemTower, TowerFeature
from gr.prefix_dnn import PrefixDNN
from gr.sparse.tables import TableConfig, sparse_backend
from gr.train.config import ModuleSpec, OptimizerSection, TrainConfig

SAMPLED_ITEMS = "sampled_item_id"
EMPTY_HISTORY = "empty_history"  # GRModel's parameter (and state dict key): the HSTU state of a user with no history
CONTEXT_ARGUMENTS = ("hidden_dim", "feature_dims", "common_dims", "embedding_dim", "tasks")


def build_tables(config: TrainConfig, spec: FeatureSpec, for_training: bool = True) -> List[TableConfig]:
    """The configured tables with rows resolved from the data, checked against its features.

    for_training: give the retrieval item table the ``SAMPLED_ITEMS`` feature too.
    """
    cardinalities = {**spec.sequence, **spec.common, **spec.token_lists}
    tables = [TableConfig.from_dict(t, f"model.tables[{i}]", cardinalities) for i, t in enumerate(config.model.tables)]
    by_feature = {f: t for t in tables for f in t.features}
    for kind, features in (("sequence", spec.sequence), ("common", spec.common), ("token_bag", spec.token_lists)):
        missing = [f for f in features if f not in by_feature]
        if missing:
            raise ValueError(
                f"model.tables: no table reads the data's {kind} feature(s) {missing}; add a table of kind "
                f"{kind!r} for them (num_embeddings: null sizes it from the data), or switch the side features "
                "off (data.item_features / data.user_features) or remove them from data.columns"
            )
        for feature, cardinality in features.items():
            table = by_feature[feature]
            if table.kind != kind:
                raise ValueError(
                    f"model.tables[{table.name}].kind: feature {feature!r} is a {kind} feature, "
                    f"the table is {table.kind!r}"
                )
            if table.num_embeddings < cardinality:
                raise ValueError(
                    f"model.tables[{table.name}].num_embeddings: {table.num_embeddings} rows, but "
                    f"{feature!r} has ids up to {cardinality - 1}"
                )
    if for_training and config.task_type == "retrieval":
        item = config.task.retrieval.item_feature
        tables = [
            dataclasses.replace(t, features=(*t.features, SAMPLED_ITEMS)) if item in t.features else t for t in tables
        ]
    return tables


def item_table(tables: Sequence[TableConfig], item_feature: str) -> TableConfig:
    return next(t for t in tables if item_feature in t.features)


def build_modules(
    config: TrainConfig, spec: FeatureSpec, tasks: Sequence[str], tables: Sequence[TableConfig]
) -> Tuple[PrefixDNN, PostfixDNN]:
    """The configured PrefixDNN and PostfixDNN for data ``spec``, checked to read exactly its
    features (``check_features_read``)."""
    dims = {f: t.embedding_dim for t in tables for f in t.features}
    context: Dict[str, Any] = {
        "hidden_dim": config.model.hstu.hidden_dim,
        "feature_dims": {**{f: dims[f] for f in (*spec.sequence, *spec.token_lists)}, **spec.token_dense},
        "common_dims": {**{f: dims[f] for f in spec.common}, **spec.common_dense},
        "tasks": list(tasks),
    }
    if config.task_type == "retrieval":
        context["embedding_dim"] = item_table(tables, config.task.retrieval.item_feature).embedding_dim
    prefix = instantiate(config.model.prefix_dnn, context, "model.prefix_dnn")
    postfix = instantiate(config.model.postfix_dnn, context, "model.postfix_dnn")
    if config.task_type == "retrieval" and not callable(getattr(postfix, "item_embedding", None)):
        raise ValueError(
            f"model.postfix_dnn.class: retrieval scores items with the head's item_embedding(rows); "
            f"{type(postfix).__name__} has none (RetrievalHead does)"
        )
    assert isinstance(prefix, PrefixDNN) and isinstance(postfix, PostfixDNN)  # ModuleSpec checked the classes
    check_features_read(prefix, postfix, spec)
    return prefix, postfix


def check_features_read(prefix: PrefixDNN, postfix: PostfixDNN, spec: FeatureSpec) -> None:
    """Every feature of ``spec`` is read by a module (the PrefixDNN's ``feature_names``, the
    PostfixDNN's ``common_feature_names``; the item id may go unread), and no module reads a
    feature ``spec`` lacks: ValueError in one line naming the features otherwise."""
    token, common = [*spec.sequence, *spec.token_lists, *spec.token_dense], [*spec.common, *spec.common_dense]
    readers = (
        ("model.prefix_dnn", prefix, tuple(prefix.feature_names), "token", token),
        ("model.postfix_dnn", postfix, tuple(postfix.common_feature_names), "common", common),
    )
    for where, module, names, kind, declared in readers:
        undeclared = [n for n in names if n not in declared]
        if undeclared:
            raise ValueError(
                f"{where}: {type(module).__name__} reads {kind} feature(s) {undeclared}, which the data does "
                f"not declare (its {kind} features: {declared}; see data.columns, data.item_features and "
                "data.user_features)"
            )
    read = {name for _, _, names, _, _ in readers for name in names}
    unread = [name for name in [*token, *common] if name not in read and name != ITEM_ID]
    if unread:
        reads = ", ".join(f"{where} {type(m).__name__} reads {list(names)}" for where, m, names, _, _ in readers)
        raise ValueError(
            f"data: declared feature(s) {unread} are read by no module ({reads}); give them to a module (its "
            "feature_dims / common_dims) or stop declaring them (data.columns, data.item_features / data.user_features)"
        )


def check_declared_features(config: TrainConfig) -> None:
    """Before any data is read: the tables and modules of ``config`` fit the features its data
    declares (``gr.data.declared``): a table for each categorical feature, every feature read,
    none read that is not declared. The modules are built on the meta device (no memory)."""
    spec = declared_spec(config.data)
    tables = build_tables(config, spec, for_training=False)
    with torch.device("meta"):
        build_modules(config, spec, config.data.label_names(), tables)
        build_item_tower(config, spec, tables)


def build_item_tower(config: TrainConfig, spec: FeatureSpec, tables: Sequence[TableConfig]) -> Optional[ItemTower]:
    """The ``model.item_tower`` of ``config`` for data ``spec`` (None when not configured), its
    features checked to be declared item features: ValueError in one line naming the key otherwise."""
    section = config.model.item_tower
    if section is None:
        return None
    where = "model.item_tower.features"
    table_of = {f: t for t in tables for f in t.features}
    item = config.task.retrieval.item_feature
    events = set(spec.event_features)
    features = []
    for name in section.features:
        if name == item or name in events:
            what = "the item itself" if name == item else "a feature of the interaction, not of the item"
            raise ValueError(f"{where}: {name!r} is {what}; the tower reads item features")
        if name in spec.sequence or name in spec.token_lists:
            table = table_of[name]
            kind = "categorical" if name in spec.sequence else "list"
            features.append(TowerFeature(name, kind, table.num_embeddings, table.embedding_dim))
        elif name in spec.token_dense:
            features.append(TowerFeature(name, "dense", 0, spec.token_dense[name]))
        else:
            declared = [f for f in (*spec.sequence, *spec.token_lists, *spec.token_dense) if f != item]
            item_features = [f for f in declared if f not in events]
            raise ValueError(
                f"{where}: {name!r} is not a declared item feature (item features: {item_features}; see "
                "data.item_features and data.columns)"
            )
    if section.popularity:
        if POPULARITY_FEATURE in (*spec.sequence, *spec.token_lists, *spec.token_dense):
            raise ValueError(
                f"model.item_tower.popularity: the data declares a feature named {POPULARITY_FEATURE!r}, the name "
                "of the tower's derived popularity; rename that feature"
            )
        features.append(TowerFeature(POPULARITY_FEATURE, "popularity", 0, 1))
    items = item_table(tables, item)
    encoder = ItemEncoder(features, items.embedding_dim, section.mlp_dims)
    return ItemTower(item, (item, SAMPLED_ITEMS), items.num_embeddings, encoder, section.id_dropout)


def build_model(
    config: TrainConfig, spec: FeatureSpec, tasks: Sequence[str] = (), for_training: bool = True
) -> GRModel:
    """A fresh GRModel (tables unsharded, on CPU). Seed torch first for identical ranks.

    Its tables are of ``sparse.backend`` when built for training; otherwise (a trained model
    loaded back, exported, evaluated) of the torch backend, whatever trained it: the same
    parameters and lookups, with no TorchRec needed."""
    tables = build_tables(config, spec, for_training)
    prefix, postfix = build_modules(config, spec, tasks, tables)
    with sparse_backend(config.sparse.backend if for_training else "torch"):
        model = config.model.model_class()(config.model.hstu, prefix, postfix, tables)
    model.embeddings.dedup = config.sparse.dedup
    tower = build_item_tower(config, spec, tables)
    if tower is not None:
        model.item_tower = tower
    if learns_new_user_query(config, postfix):  # drawn last: every other parameter starts as without it
        dim = config.model.hstu.hidden_dim
        model.empty_history = nn.Parameter(torch.randn(dim) * dim**-0.5)
    return model


def learns_new_user_query(config: TrainConfig, postfix: PostfixDNN) -> bool:
    """Whether the model learns ``GRModel.empty_history``: ``task.retrieval.new_user_query`` of a
    retrieval task, and where that is null, whether ``postfix`` reads common features."""
    if config.task_type != "retrieval":
        return False
    chosen = config.task.retrieval.new_user_query
    return bool(postfix.common_feature_names) if chosen is None else chosen


def without_empty_history(model: GRModel, keys: Collection[str]) -> GRModel:
    """``model`` without ``empty_history`` when a checkpoint's model state dict ``keys`` (unprefixed) lack it (a model
    trained before it existed, or with it off): such a checkpoint loads as the model it was, with
    no new-user query."""
    if model.empty_history is not None and EMPTY_HISTORY not in keys:
        model.empty_history = None
    return model


def instantiate(spec: ModuleSpec, context: Mapping[str, Any], where: str) -> nn.Module:
    """spec.cls(**kwargs), with context arguments filled in (see the module docstring)."""
    cls: type[Any] = spec.cls
    parameters = inspect.signature(cls.__init__).parameters
    kwargs = dict(spec.kwargs)
    for name in CONTEXT_ARGUMENTS:
        if name in parameters and name not in kwargs and name in context:
            kwargs[name] = context[name]
        elif name in ("feature_dims", "common_dims") and isinstance(kwargs.get(name), list):
            unknown = [f for f in kwargs[name] if f not in context[name]]
            if unknown:
                raise ValueError(
                    f"{where}.kwargs.{name}: the data has no feature(s) {unknown}; it has {sorted(context[name])}"
                )
            kwargs[name] = {f: context[name][f] for f in kwargs[name]}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {cls.__name__}(**{sorted(kwargs)}) failed: {error}") from error
    except KeyError as error:  # a module looking up a feature by name in feature_dims / common_dims
        raise ValueError(
            f"{where}: {cls.__name__} looks up {error}, which the data does not declare (token features: "
            f"{sorted(context['feature_dims'])}, common features: {sorted(context['common_dims'])})"
        ) from error


def seeded_model(config: TrainConfig, spec: FeatureSpec, tasks: Sequence[str] = ()) -> GRModel:
    """``build_model`` under ``trainer.seed``, so every rank (and every run) starts from the same weights."""
    with torch.random.fork_rng():
        torch.manual_seed(config.trainer.seed)
        with torch.device("cpu"):
            return build_model(config, spec, tasks)


def dense_optimizer(config: OptimizerSection, params: Sequence[nn.Parameter]) -> torch.optim.Optimizer:
    """The dense parameters' optimizer from ``optimizer``. Adam(W) runs PyTorch's fused kernel when
    every parameter is a plain CPU or CUDA tensor (on CPU one call instead of ~10 ops per
    parameter: 0.13 against 0.59 ms a step for the ML-1M recipe's 21 tensors), else its default."""
    if config.type == "sgd":
        return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
    cls = torch.optim.AdamW if config.type == "adamw" else torch.optim.Adam
    fused = all(type(p) is nn.Parameter and p.device.type in ("cpu", "cuda") for p in params) or None
    return cls(params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay, fused=fused)
