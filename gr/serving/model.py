"""One loaded export: sparse store, id maps, ONNX Runtime sessions and the HSTU engine, wired by
slice_graph.ini, on one device (cpu, cuda or npu): the ONNX slices run with that device's
execution provider, the HSTU engine and its caches live on it, and tensors cross to and from
numpy at the ONNX boundaries only. Imports no training code."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from gr.export.delta import APPEND, Delta, appended_map, export_identity
from gr.export.format import (
    BAG,
    HSTU_CONFIG,
    HSTU_OUTPUT,
    HSTU_SLICE,
    HSTU_WEIGHTS,
    ID_MAPS_DIR,
    POSTFIX,
    POSTFIX_ONNX,
    PREFIX,
    PREFIX_ONNX,
    PREFIX_OUTPUT,
    REPEAT_PER_TARGET,
    SPARSE,
    SPARSE_DIR,
    TIMESTAMPS,
    TOKEN_BAGS,
    TOKENS,
    ExportFormatError,
    Problem,
)
from gr.export.item_store import ITEM_STORE, load_item_store
from gr.export.new_user import EMPTY_HISTORY_FILE, read_empty_history
from gr.export.popularity import POPULARITY, read_popularity
from gr.export.reader import load_hstu, open_export
from gr.export.slice_graph import REQUEST
from gr.export.sparse_manifest import TOKEN_KINDS, SparseManifest
from gr.hstu.cache import CachedHSTU
from gr.serving.catalogue import QUERY, Catalogue
from gr.serving.errors import ScoringError
from gr.serving.id_maps import IdMaps
from gr.serving.onnx_slice import OnnxSlice, execution_providers
from gr.serving.options import INDEXES
from gr.serving.request import RequestSchema
from gr.serving.sparse_store import SparseStore, patch_table
from gr.utils.devices import DEVICES, require_device

Tokens = Dict[str, np.ndarray]
HISTORY_FILES = (PREFIX_ONNX, HSTU_CONFIG, HSTU_WEIGHTS, ITEM_STORE)  # what a cached history is computed from


class ServingModel:
    """One loaded export: sparse store, ONNX Runtime sessions and the HSTU engine, wired by the graph."""

    def __init__(
        self, export_dir: Union[str, Path], threads: Optional[int] = None, index: str = "exact", device: str = "cpu"
    ) -> None:
        """index: the catalogue's item index, "exact" or "hnsw" (approximate; needs faiss-cpu).
        device: "cpu", "cuda" or "npu" (checked by ``check_device`` before anything is loaded)."""
        if index not in INDEXES:
            raise ValueError(f"ServingModel.index: expected one of {list(INDEXES)}, got {index!r}")
        check_device(device)
        self.index = index
        self.device = device
        self.threads = threads
        manifest = open_export(export_dir)
        self.root = manifest.root
        self.identity = export_identity(manifest.root)  # what a delta names as its base (gr.export.delta)
        self.sparse_manifest = manifest.sparse
        self.graph = manifest.graph
        self.config = manifest.hstu_config
        self.sparse = SparseStore(manifest)
        stored = () if self.sparse.items is None else tuple(self.sparse.items.features)
        self.id_maps = IdMaps(manifest.root, manifest.sparse)
        self.schema = RequestSchema.from_graph(self.graph, stored, self.id_maps.has_unknown_row)
        self.prefix = OnnxSlice(manifest.path(PREFIX_ONNX), self.graph.slice(PREFIX), threads, device)
        self.engine = CachedHSTU(load_hstu(manifest.root).to(device))
        self.postfix = OnnxSlice(manifest.path(POSTFIX_ONNX), self.graph.slice(POSTFIX), threads, device)
        self.popularity: Optional[np.ndarray] = read_popularity(manifest.root)  # [items] int64 counts, or None
        self.empty_history: Optional[np.ndarray] = read_empty_history(manifest.root)  # [D] float32, or None
        self._catalogue: Optional[Catalogue] = None
        self._catalogue_lock = threading.Lock()

    def applied(self, deltas: Sequence[Delta]) -> Tuple["ServingModel", bool]:
        """(this model with ``deltas`` applied in order, whether a cached history of this model
        still holds for it). ``deltas`` chain from this model (``gr.export.delta.chain_deltas``).

        This model is left as it is: a changed table is its rows with the delta's over them
        (``gr.serving.sparse_store.patch_table``: no copy of the table), a changed ONNX or HSTU
        slice, item store, popularity or new-user state is loaded from the delta, id maps grow by
        the delta's lines; every other part is shared. A cached history is computed from the token
        features' tables, the item store and the prefix and HSTU slices: it holds when none of
        them changed."""
        model = copy.copy(self)
        sparse = model.sparse = copy.copy(self.sparse)
        sparse.tables = dict(self.sparse.tables)
        id_maps = model.id_maps = copy.copy(self.id_maps)
        id_maps.maps = dict(self.id_maps.maps)
        cache_holds = True
        token_tables = {f.table for f in self.sparse_manifest.features.values() if f.kind in TOKEN_KINDS}
        for delta in deltas:
            for name, table in delta.tables.items():
                if table.changed:
                    sparse.tables[name] = patch_table(sparse.tables[name], table.rows, *delta.table_rows(name))
                    cache_holds = cache_holds and name not in token_tables
            for rel, kind in delta.files.items():
                cache_holds = cache_holds and rel not in HISTORY_FILES
                if rel.startswith(f"{ID_MAPS_DIR}/"):
                    _extend_maps(id_maps, self.sparse_manifest, delta, rel, kind)
            files = set(delta.files)
            if PREFIX_ONNX in files:
                model.prefix = OnnxSlice(delta.root / PREFIX_ONNX, self.graph.slice(PREFIX), self.threads, self.device)
            if POSTFIX_ONNX in files:
                model.postfix = OnnxSlice(
                    delta.root / POSTFIX_ONNX, self.graph.slice(POSTFIX), self.threads, self.device
                )
            if HSTU_WEIGHTS in files:
                model.engine = CachedHSTU(load_hstu(delta.root).to(self.device))
            if ITEM_STORE in files or ITEM_STORE in delta.removed:
                sparse.items = load_item_store(delta.root, self.graph, self.sparse_manifest)
                cache_holds = False
            if POPULARITY in files or POPULARITY in delta.removed:
                model.popularity = read_popularity(delta.root)
            if EMPTY_HISTORY_FILE in files or EMPTY_HISTORY_FILE in delta.removed:
                model.empty_history = read_empty_history(delta.root)
            model.root, model.identity = delta.root, delta.target
        model._catalogue = None  # built from the new item table on first use
        model._catalogue_lock = threading.Lock()
        return model, cache_holds

    @property
    def is_retrieval(self) -> bool:
        """Whether the postfix_dnn is a retrieval head (a ``query`` output scored against the item table)."""
        return QUERY in self.postfix.output_names

    def catalogue(self) -> Catalogue:
        """The item catalogue of this export (built on first use; RequestError if it has none)."""
        with self._catalogue_lock:
            if self._catalogue is None:
                self._catalogue = Catalogue(self, index=self.index)
            return self._catalogue

    def embed_tokens(self, tokens: Tokens) -> Tensor:
        """Token columns -> [T, D] HSTU input on the model's device: sparse lookups (a list feature's
        bags come pooled, as ``RequestSchema.tokens`` validated them), then the prefix_dnn slice."""
        count = len(tokens[TIMESTAMPS])
        if count == 0:
            return torch.zeros(0, self.config.hidden_dim, device=self.device)
        env = {f"{REQUEST}.{name}": value for name, value in tokens.items()}
        for t in self.graph.slice(SPARSE).inputs:
            if t.shape == (TOKENS,):
                env[f"{SPARSE}.{t.name}"] = self.sparse.sequence(t.name, env[t.input_source])
            elif t.shape == TOKEN_BAGS:
                env[f"{SPARSE}.{t.name}"] = env[t.input_source]
        out = self.prefix.run({t.name: env[t.input_source] for t in self.prefix.spec.inputs})
        return torch.from_numpy(out[PREFIX_OUTPUT]).to(self.device)

    def heads(self, hidden: Tensor, common: Tokens) -> Dict[str, np.ndarray]:
        """hidden: [N, D] HSTU outputs at the candidates -> {task: [N, ...]} via the postfix_dnn slice.

        Raises ScoringError when an output is not finite."""
        return self.heads_batch(hidden, [common], [hidden.shape[0]])

    def heads_batch(self, hidden: Tensor, commons: Sequence[Tokens], rows: Sequence[int]) -> Dict[str, np.ndarray]:
        """``heads`` for B requests in one postfix_dnn run: hidden [N, D] holds request b's
        ``rows[b]`` candidates after request b-1's; each request's common features go to its rows."""
        envs = [self._common_inputs(common) for common in commons]
        inputs = {}
        for t in self.postfix.spec.inputs:
            if t.source == f"{HSTU_SLICE}.{HSTU_OUTPUT}":
                inputs[t.name] = hidden.cpu().numpy()
            elif t.repeat == REPEAT_PER_TARGET:
                inputs[t.name] = np.concatenate(
                    [np.repeat(env[t.input_source], n, axis=0) for env, n in zip(envs, rows)]
                )
            else:
                raise ValueError(
                    f"{POSTFIX}: input {t.name} reads {t.source}, neither the HSTU output nor repeated per target"
                )
        out = self.postfix.run(inputs)
        check_finite(out, "postfix_dnn")
        return out

    def new_user_queries(self, commons: Sequence[Tokens]) -> Tensor:
        """[B, d] the retrieval queries of B users with no history: the postfix_dnn slice on the
        export's ``empty_history`` with each user's validated common features (needs both)."""
        if self.empty_history is None:
            raise ValueError(f"{self.root}: the export stores no empty_history (gr.export.new_user)")
        hidden = torch.from_numpy(self.empty_history).unsqueeze(0).expand(len(commons), -1)
        return torch.from_numpy(self.heads_batch(hidden, commons, [1] * len(commons))[QUERY])

    def _common_inputs(self, common: Tokens) -> Dict[str, np.ndarray]:
        """One request's common features by graph source name (ids pooled through the sparse store)."""
        env: Dict[str, np.ndarray] = {f"{REQUEST}.{name}": value for name, value in common.items()}
        for t in self.graph.slice(SPARSE).inputs:
            if t.shape == (BAG,):
                env[f"{SPARSE}.{t.name}"] = self.sparse.pooled(t.name, env[t.input_source])
        return env


def _extend_maps(id_maps: IdMaps, sparse: SparseManifest, delta: Delta, rel: str, kind: str) -> None:
    """Grow the maps of every feature whose ``id_mapping`` is ``rel`` by the lines ``delta`` adds."""
    features = [f.name for f in sparse.features.values() if f"{SPARSE_DIR}/{f.id_mapping}" == rel]
    if kind != APPEND and features:
        raise ExportFormatError(
            [Problem(str(delta.root / rel), "-", "an id map replaced, not extended: reload the squashed full export")]
        )
    for feature in features:
        id_maps.maps[feature] = appended_map(
            id_maps.maps[feature], (delta.root / rel).read_bytes(), str(delta.root / rel)
        )


def check_device(device: str) -> None:
    """Check that ``--device`` (cpu|cuda|npu) can serve here: torch sees it (torch_npu is loaded
    for "npu" through ``gr.utils.devices``, never otherwise) and ONNX Runtime has its execution
    provider. Raises ValueError for an unknown name, one RuntimeError naming all that is missing."""
    if device not in DEVICES:
        raise ValueError(f"--device: expected one of {list(DEVICES)}, got {device!r}")
    missing = []
    for check in (lambda: require_device(device, "--device"), lambda: execution_providers(device)):
        try:
            check()
        except RuntimeError as err:
            missing.append(str(err))
    if missing:
        raise RuntimeError("; ".join(missing))


def check_finite(outputs: Dict[str, np.ndarray], where: str) -> None:
    """Raise ScoringError naming the first output holding NaN or infinity."""
    for name, value in outputs.items():
        if not np.isfinite(value).all():
            raise ScoringError(
                f"{where} output {name!r}: non-finite values (NaN or infinity); the model or its "
                "inputs are broken, no score is returned"
            )
