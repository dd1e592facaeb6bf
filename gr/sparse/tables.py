"""Sparse id features: embedding tables built from the config, on one of two backends.

``sparse.backend`` picks the modules that hold the tables: "torchrec" (TorchRec's
EmbeddingCollection / EmbeddingBagCollection, sharded over ranks by DistributedModelParallel,
``gr.sparse.torchrec_tables``) or "torch" (plain ``nn.Embedding`` / ``nn.EmbeddingBag`` on one
rank, ``gr.sparse.torch_tables``). Both lay their parameters out alike, so state dicts,
checkpoints and exports are the same either way. TorchRec is imported only by its backend.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from importlib import import_module
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from gr.sparse.config import BACKEND_MODULES, SPARSE_BACKENDS, TableConfig
from gr.sparse.dedup import unique_ids
from gr.sparse.keyed_jagged import JaggedTensor, KeyedJaggedTensor
from gr.utils.config_checks import one_of, require

_BACKEND: ContextVar[str] = ContextVar("sparse_backend", default="torchrec")
POOLED_ATTRIBUTES = {"common": "common", "token_bag": "token_bags"}  # kind -> its SparseEmbeddings collection
# FBGEMM's embedding kernels store rows in multiples of 4 floats.
DIM_ALIGNMENT = 4


def storage_dim(embedding_dim: int) -> int:
    """Row width a table is stored with: ``embedding_dim`` rounded up to FBGEMM's alignment.

    A table of dim 50 (the HSTU paper's) is stored 52 wide; lookups return its first 50
    columns, so the 2 padding columns never get a gradient and never reach the model.
    """
    return -(-embedding_dim // DIM_ALIGNMENT) * DIM_ALIGNMENT


@contextmanager
def sparse_backend(name: str) -> Iterator[None]:
    """SparseEmbeddings built inside take backend ``name`` (one of ``SPARSE_BACKENDS``) unless told
    otherwise: how a GRModel, which builds its own tables, gets the configured backend."""
    require("sparse.backend", name, one_of(*SPARSE_BACKENDS))
    token = _BACKEND.set(name)
    try:
        yield
    finally:
        _BACKEND.reset(token)


def backend_module(name: str) -> Any:
    """The module implementing backend ``name`` (imported on first use). A TorchRec that does not
    import is a one-line ImportError naming ``sparse.backend`` and the way out."""
    try:
        return import_module(BACKEND_MODULES[name])
    except ImportError as error:
        if name != "torchrec":
            raise
        raise ImportError(
            f"sparse.backend: 'torchrec' needs TorchRec and fbgemm-gpu, which do not import here ({error}); "
            "install them, or train with sparse.backend: torch (plain torch tables, one rank)"
        ) from error


class SparseEmbeddings(nn.Module):
    """Looks up sequence ids per token, common ids per request and token bags per token.

    ``sequence`` (EmbeddingCollection per embedding dim), ``common`` and ``token_bags``
    (EmbeddingBagCollections: a request's bag, a token's bag; None without such tables), or
    their torch counterparts (``backend``), hold the tables; with TorchRec they are the modules
    DistributedModelParallel shards. Each
    collection always receives every feature it was built with, in its own order
    (features absent from a batch get no ids), because a sharded collection fixes its
    input layout at its first call. Tables are stored ``storage_dim`` wide; lookups are
    cut back to each table's ``embedding_dim`` (``table_weight`` gives the unpadded rows).

    dedup: look each distinct id of a table up once per batch ("unique before lookup"):
        the ids of all features reading a table are made unique, looked up, and scattered
        back, so the kernel's backward accumulates one gradient row per distinct id.
        Long sequences repeat ids a lot (an ML-100K batch: ~12k item tokens, <1.7k distinct).
    output_device: where looked-up vectors go (None: where the tables are), e.g. the
        accelerator running the dense model while the tables live in host memory.
    backend: one of ``SPARSE_BACKENDS``; None -> the one ``sparse_backend`` set ("torchrec" by default).
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        device: Optional[str] = None,
        dedup: bool = False,
        output_device: Optional[torch.device] = None,
        backend: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.backend = backend or _BACKEND.get()
        require("sparse.backend", self.backend, one_of(*SPARSE_BACKENDS))
        modules = backend_module(self.backend)
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"tables: duplicate table names in {names}")
        features = [f for t in tables for f in t.features]
        if len(set(features)) != len(features):
            raise ValueError(f"tables: a feature is mapped to two tables: {features}")
        self.tables = {t.name: t for t in tables}
        self.feature_to_table = {f: t for t in tables for f in t.features}
        self.dedup = dedup
        self.output_device = output_device
        seq = [t for t in tables if t.kind == "sequence"]
        common = [t for t in tables if t.kind == "common"]
        # TorchRec wants one embedding dim per EmbeddingCollection: one collection per dim.
        self.sequence = nn.ModuleDict(
            {
                f"dim{dim}": modules.sequence_collection([t for t in seq if t.embedding_dim == dim], device)
                for dim in sorted({t.embedding_dim for t in seq})
            }
        )
        self.sequence_features = {
            name: [f for t in seq if f"dim{t.embedding_dim}" == name for f in t.features] for name in self.sequence
        }
        self.common = modules.pooled_collection(common, device) if common else None
        self.common_features = [f for t in common for f in t.features]
        bags = [t for t in tables if t.kind == "token_bag"]
        self.token_bags = modules.pooled_collection(bags, device) if bags else None
        self.token_bag_features = [f for t in bags for f in t.features]

    def pooled_collections(self) -> Dict[str, nn.Module]:
        """{attribute: EmbeddingBagCollection} of the pooled tables' collections this model has."""
        found = {name: getattr(self, name) for name in POOLED_ATTRIBUTES.values()}
        return {name: collection for name, collection in found.items() if collection is not None}

    def feature_dim(self, feature: str) -> int:
        return self.feature_to_table[feature].embedding_dim

    def table_weight(self, name: str) -> Tensor:
        """The rows of (unsharded) table ``name``: [num_embeddings, embedding_dim] float."""
        table = self.tables[name]
        if table.kind == "sequence":
            collection: Any = self.sequence[f"dim{table.embedding_dim}"]  # the backend's EmbeddingCollection
            weight = collection.embeddings[name].weight
        else:
            bags: Any = self.pooled_collections()[POOLED_ATTRIBUTES[table.kind]]  # an EmbeddingBagCollection
            weight = bags.embedding_bags[name].weight
        return weight[:, : table.embedding_dim]

    def forward(
        self,
        sequence_ids: Optional[KeyedJaggedTensor],
        common_ids: Optional[KeyedJaggedTensor],
        token_lists: Optional[KeyedJaggedTensor] = None,
    ) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
        """sequence_ids: KJT, stride B -> {feature: [N_f, d]}, one row per id of the feature
        (one per token for token features); common_ids: KJT, stride B -> {feature: [B, d]} (pooled);
        token_lists: KJT, stride T -> {feature: [T, d]} (each token's bag pooled), with the sequence
        features in the first mapping."""
        seq_out: Dict[str, Tensor] = {}
        common_out: Dict[str, Tensor] = {}
        if sequence_ids is not None:
            unknown = [
                k
                for k in sequence_ids.keys()
                if self.feature_to_table.get(k, None) is None or self.feature_to_table[k].kind != "sequence"
            ]
            if unknown:
                raise ValueError(f"sequence ids: features {unknown} have no table of kind 'sequence'")
            jagged = sequence_ids.to_dict()
            for name, collection in self.sequence.items():
                if any(f in jagged for f in self.sequence_features[name]):
                    lookup = self._lookup_unique if self.dedup else self._lookup
                    seq_out.update(lookup(collection, self.sequence_features[name], jagged))
        if common_ids is not None:
            common_out = self._pool(self.common, self.common_features, common_ids, "common ids", "common")
        if token_lists is not None:
            seq_out.update(
                self._pool(self.token_bags, self.token_bag_features, token_lists, "token lists", "token_bag")
            )
        if self.output_device is not None:
            seq_out = {k: v.to(self.output_device, non_blocking=True) for k, v in seq_out.items()}
            common_out = {k: v.to(self.output_device, non_blocking=True) for k, v in common_out.items()}
        return seq_out, common_out

    def _pool(
        self, collection: Optional[nn.Module], features: List[str], ids: KeyedJaggedTensor, what: str, kind: str
    ) -> Dict[str, Tensor]:
        """ids: KJT of stride S (one bag per sample) -> {feature: [S, d]}, each bag pooled by its table."""
        unknown = [k for k in ids.keys() if k not in features]
        if unknown or collection is None:
            raise ValueError(f"{what}: features {unknown or ids.keys()} have no table of kind {kind!r}")
        pooled = collection(self._full_kjt(features, ids.to_dict(), ids.stride()))
        pooled = pooled if isinstance(pooled, dict) else pooled.to_dict()  # TorchRec's: a KeyedTensor
        return {k: pooled[k][:, : self.feature_dim(k)] for k in ids.keys()}

    def _lookup(self, collection: nn.Module, features: List[str], jagged: Dict[str, JaggedTensor]) -> Dict[str, Tensor]:
        stride = next(jagged[f].lengths().numel() for f in features if f in jagged)
        looked_up = collection(self._full_kjt(features, jagged, stride))
        dim = self.feature_dim(features[0])
        return {f: looked_up[f].values()[:, :dim] for f in features if f in jagged}

    def _lookup_unique(
        self, collection: nn.Module, features: List[str], jagged: Dict[str, JaggedTensor]
    ) -> Dict[str, Tensor]:
        """Per table: unique ids over all its present features -> one lookup -> scatter back."""
        present = [f for f in features if f in jagged]
        by_table: Dict[str, List[str]] = {}
        for f in present:
            by_table.setdefault(self.feature_to_table[f].name, []).append(f)
        distinct_ids: Dict[str, JaggedTensor] = {}
        inverse: Dict[str, Tensor] = {}
        for table, table_features in by_table.items():
            ids = torch.cat([jagged[f].values() for f in table_features])
            unique, inverse[table] = unique_ids(ids, self.tables[table].num_embeddings)
            # One "sample" holding every distinct id, under the table's first feature.
            carrier = self.tables[table].features[0]
            distinct_ids[carrier] = JaggedTensor(values=unique, lengths=unique.new_tensor([unique.numel()]))
        looked_up = collection(self._full_kjt(features, distinct_ids, 1))
        out: Dict[str, Tensor] = {}
        for table, table_features in by_table.items():
            rows = looked_up[self.tables[table].features[0]].values()[:, : self.tables[table].embedding_dim]
            rows = rows.index_select(0, inverse[table])  # backward: index_add_, ~10x an indexing's index_put_
            sizes = [jagged[f].values().numel() for f in table_features]
            out.update(zip(table_features, torch.split(rows, sizes)))
        return out

    def _full_kjt(self, features: List[str], jagged: Dict[str, JaggedTensor], stride: int) -> Any:
        """The backend's KJT with every feature in ``features`` (that order); features not in
        ``jagged`` get no ids."""
        template = next(iter(jagged.values()))
        empty = template.lengths().new_zeros(stride)
        present = [jagged[f] for f in features if f in jagged]
        return backend_module(self.backend).KeyedJaggedTensor(
            keys=list(features),
            values=torch.cat([jt.values() for jt in present]),
            lengths=torch.cat([jagged[f].lengths() if f in jagged else empty for f in features]),
            stride=stride,
        )
