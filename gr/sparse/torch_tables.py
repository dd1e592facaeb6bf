"""The torch backend's tables: plain ``nn.Embedding`` / ``nn.EmbeddingBag`` laid out as TorchRec's modules.

``TableCollection`` stands for TorchRec's EmbeddingCollection (one vector per id) and
``PooledTableCollection`` for its EmbeddingBagCollection (a sample's ids pooled, sum or mean):
the same attribute and parameter names (``embeddings.<table>.weight``,
``embedding_bags.<table>.weight``), initialised the same way in the same random order, so a
seeded model, its state dict and its checkpoints are the same under either backend. Everything
here is plain torch: it runs wherever torch does (CPU, CUDA, MPS), on one rank.

Training (``prepare_for_training``): ``attach_optimizers`` gives each table a ``RowOptimizer``;
a lookup then runs through ``_UpdateInBackward``, whose backward hands the ids and their
gradients to the table's optimizer (which updates the rows looked up) instead of forming a
weight gradient, as TorchRec's fused kernels do. Without an optimizer (evaluation, export) or
gradients, a lookup is ``F.embedding`` / ``F.embedding_bag``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gr.jagged import offsets_from_lengths
from gr.sparse.keyed_jagged import JaggedTensor, KeyedJaggedTensor
from gr.sparse.optimizer import EmbeddingOptimizerConfig
from gr.sparse.row_optimizers import RowOptimizer, TableOptimizers
from gr.sparse.sharding import EMBEDDINGS_ATTR, table_device
from gr.sparse.tables import SparseEmbeddings, TableConfig, storage_dim
from gr.sparse.touched import Drain

__all__ = [
    "KeyedJaggedTensor",
    "attach_optimizers",
    "pooled_collection",
    "prepare_for_training",
    "sequence_collection",
    "track_updated_rows",
]


class _UpdateInBackward(torch.autograd.Function):
    """rows = lookup(weight, ids[, offsets]); backward gives d loss / d rows to the table's optimizer."""

    @staticmethod
    def forward(
        ctx: Any, weight: Tensor, ids: Tensor, offsets: Optional[Tensor], mode: str, optimizer: RowOptimizer
    ) -> Tensor:
        ctx.optimizer, ctx.mode = optimizer, mode
        ctx.save_for_backward(ids, offsets)
        return _lookup(weight, ids, offsets, mode)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        ids, offsets = ctx.saved_tensors
        if offsets is not None:  # pooled: each id gets its sample's gradient (divided by the count for "mean")
            lengths = offsets.diff()
            sample = torch.repeat_interleave(torch.arange(lengths.numel(), device=ids.device), lengths)
            grad = grad.index_select(0, sample)
            if ctx.mode == "mean":
                grad = grad / lengths.index_select(0, sample).unsqueeze(1).to(grad.dtype)
        ctx.optimizer.update(ids, grad)
        return None, None, None, None, None


def _lookup(weight: Tensor, ids: Tensor, offsets: Optional[Tensor], mode: str) -> Tensor:
    """ids: [N] -> [N, D] rows; with offsets [S+1] -> [S, D], sample s pooling ids[offsets[s]:offsets[s+1]]."""
    if offsets is None:
        return F.embedding(ids, weight)
    return F.embedding_bag(ids, weight, offsets, mode=mode, include_last_offset=True)


class _Tables(nn.Module):
    """Lookups in tables held in ``self.<attribute>`` (a ModuleDict by table name), each optionally
    with a RowOptimizer (``optimizers``, set by ``attach_optimizers``)."""

    attribute = ""

    def __init__(self, tables: Sequence[TableConfig]) -> None:
        super().__init__()
        self.table_features = {t.name: list(t.features) for t in tables}
        self.modes = {t.name: t.pooling for t in tables}
        self.optimizers: Dict[str, RowOptimizer] = {}

    def lookup(self, table: str, ids: Tensor, offsets: Optional[Tensor] = None) -> Tensor:
        weight = getattr(self, self.attribute)[table].weight
        optimizer = self.optimizers.get(table)
        if optimizer is None or not torch.is_grad_enabled():
            return _lookup(weight, ids, offsets, self.modes[table])
        return _UpdateInBackward.apply(weight, ids, offsets, self.modes[table], optimizer)

    def _by_table(self, features: KeyedJaggedTensor) -> Iterator[Tuple[str, Dict[str, JaggedTensor]]]:
        """(table, {feature: its ids}) for each table that some feature of ``features`` reads."""
        jagged = features.to_dict()
        for table, names in self.table_features.items():
            present = {f: jagged[f] for f in names if f in jagged}
            if present:
                yield table, present


class TableCollection(_Tables):
    """TorchRec's EmbeddingCollection in plain torch: KJT -> {feature: JaggedTensor of [N_f, D] rows}.

    The ids of all features reading a table are looked up together, so a table's optimizer
    updates it once per batch."""

    attribute = "embeddings"

    def __init__(self, tables: Sequence[TableConfig], device: Optional[str] = None) -> None:
        super().__init__(tables)
        self.embeddings = nn.ModuleDict()
        for table in tables:  # EmbeddingCollection's order: each table built, then initialised
            rows, width = table.num_embeddings, storage_dim(table.embedding_dim)
            embedding = nn.Embedding(rows, width, device=device)
            self.embeddings[table.name] = embedding
            _initialise(embedding.weight, table)

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, JaggedTensor]:
        out: Dict[str, JaggedTensor] = {}
        for table, jagged in self._by_table(features):
            ids = [jt.values() for jt in jagged.values()]
            rows = self.lookup(table, torch.cat(ids) if len(ids) > 1 else ids[0])
            for (feature, jt), values in zip(jagged.items(), torch.split(rows, [i.numel() for i in ids])):
                out[feature] = JaggedTensor(values, jt.lengths())
        return out


class PooledTableCollection(_Tables):
    """TorchRec's EmbeddingBagCollection in plain torch: KJT (stride B) -> {feature: [B, D]}, each
    sample's ids pooled by its table's ``pooling`` (an empty sample pools to zeros)."""

    attribute = "embedding_bags"

    def __init__(self, tables: Sequence[TableConfig], device: Optional[str] = None) -> None:
        super().__init__(tables)
        self.embedding_bags = nn.ModuleDict()
        for table in tables:  # EmbeddingBagCollection's order: every table built, then each initialised
            self.embedding_bags[table.name] = nn.EmbeddingBag(
                table.num_embeddings,
                storage_dim(table.embedding_dim),
                mode=table.pooling,
                include_last_offset=True,
                device=device,
            )
        for table in tables:  # cast: torch's stubs type a ModuleDict's items as nn.Module
            _initialise(cast(nn.EmbeddingBag, self.embedding_bags[table.name]).weight, table)

    def forward(self, features: KeyedJaggedTensor) -> Dict[str, Tensor]:
        out: Dict[str, Tensor] = {}
        for table, jagged in self._by_table(features):
            ids = torch.cat([jt.values() for jt in jagged.values()])
            offsets = offsets_from_lengths(torch.cat([jt.lengths() for jt in jagged.values()]))
            out.update(zip(jagged, torch.split(self.lookup(table, ids, offsets), features.stride())))
        return out


def sequence_collection(tables: Sequence[TableConfig], device: Optional[str]) -> TableCollection:
    return TableCollection(tables, device)


def pooled_collection(tables: Sequence[TableConfig], device: Optional[str]) -> PooledTableCollection:
    return PooledTableCollection(tables, device)


def prepare_for_training(
    model: nn.Module, default: EmbeddingOptimizerConfig, dense_device: torch.device, placement: str = "device"
) -> TableOptimizers:
    """The torch backend's ``shard_model``, on one rank: ``model``'s modules to ``dense_device``, its
    tables to ``table_device(dense_device, placement)`` (looked-up vectors then move to
    ``dense_device``), and every table its optimizer (``attach_optimizers``)."""
    tables = table_device(dense_device, placement, backend="torch")
    for name, child in model.named_children():
        child.to(tables if name == EMBEDDINGS_ATTR else dense_device)
    if tables != dense_device:
        getattr(model, EMBEDDINGS_ATTR).output_device = dense_device
    return attach_optimizers(model, default)


def attach_optimizers(model: nn.Module, default: EmbeddingOptimizerConfig) -> TableOptimizers:
    """Give every table of ``model.embeddings`` (torch backend) its optimizer (its own, or ``default``).

    Call once the tables are on their device: each optimizer's state is made beside its weight.
    Returns them keyed by weight name in ``model``, for checkpoints."""
    embeddings = getattr(model, EMBEDDINGS_ATTR)
    if not isinstance(embeddings, SparseEmbeddings) or embeddings.backend != "torch":
        raise ValueError("attach_optimizers: expected model.embeddings to be SparseEmbeddings of the torch backend")
    names = {id(p): name for name, p in model.named_parameters()}
    # cast: torch's stubs type a ModuleDict's items as nn.Module
    collections = cast(List[_Tables], [*embeddings.sequence.values(), *embeddings.pooled_collections().values()])
    found = {}
    for collection in collections:
        for table, module in getattr(collection, collection.attribute).items():
            optimizer = RowOptimizer(embeddings.tables[table].optimizer or default, module.weight)
            collection.optimizers[table] = optimizer
            found[names[id(module.weight)]] = (table, optimizer)
    return TableOptimizers(found)


def track_updated_rows(optimizers: TableOptimizers) -> Drain:
    """Record the rows each table's optimizer updates -> a function returning {table: [n] int64
    row ids} updated since its last call (``gr.sparse.touched``)."""
    for _, optimizer in optimizers.optimizers.values():
        optimizer.updated = []

    def drain() -> Dict[str, Tensor]:
        out = {}
        for table, optimizer in optimizers.optimizers.values():
            assert optimizer.updated is not None  # set above
            if optimizer.updated:
                out[table] = torch.cat(optimizer.updated)
                optimizer.updated.clear()
        return out

    return drain


def _initialise(weight: Tensor, table: TableConfig) -> None:
    """TorchRec's initialisation: normal(0, init_std), or uniform in ±sqrt(1 / num_embeddings)."""
    if table.init_std is not None:
        nn.init.normal_(weight, std=table.init_std)
    else:
        bound = math.sqrt(1 / table.num_embeddings)
        nn.init.uniform_(weight, a=-bound, b=bound)
