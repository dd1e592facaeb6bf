"""An export's item encoder: ``sparse/item_encoder.safetensors`` (optional), the item tower's
feature encoder of a model trained with ``model.item_tower`` (``gr.postfix_dnn.item_tower``).

The export's item table already holds each item's vector as the model embeds it (its id row plus
the encoder of its features), so serving reads neither this file nor anything new. ``gr items
add`` reads it: a new item has no trained id part, and its row is placed from the encoder of its
features (the trained items nearest it) and its count (``gr.export.new_item_rows``).

One safetensors file: the encoder's weights (its ``state_dict``: ``bags.<feature>.weight`` [rows,
dim] per categorical or list-valued feature, ``mlp.<i>.weight`` / ``.bias``), float32; metadata
``format_version`` "1", ``item_feature``, and what rebuilds the module (``ItemEncoder.metadata``:
``features`` JSON [{name, kind, rows, dim}], ``embedding_dim``, ``mlp_dims`` JSON); optionally
``mean_query`` [embedding_dim], the mean of the normalised served queries of validation events,
which places new items' rows, and with it ``served_queries`` [S, embedding_dim], those queries,
which set the placed rows' level (``gr.export.new_item_rows``). Each feature is
one of the item store's (``gr.export.item_store``), a bag's rows those of the feature's table, but
a "popularity" one (the item's ``log1p`` count): its values come from ``sparse/popularity.safetensors``.
Covered by the MANIFEST like every other file; ``check_item_encoder`` is what ``gr check`` and
every loader verify.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save as safetensors_bytes

from gr.export.format import Problem, read_safetensors
from gr.export.item_store import ITEM_FEATURE, ITEM_STORE
from gr.export.popularity import POPULARITY
from gr.export.sparse_manifest import SparseManifest
from gr.utils.atomic import write_bytes

ITEM_ENCODER = "sparse/item_encoder.safetensors"
MEAN_QUERY = "mean_query"  # [d]: the mean normalised served query (gr.export.new_item_rows), optional
SERVED_QUERIES = "served_queries"  # [S, d]: the normalised served queries of that mean, optional
ENCODER_FORMAT_VERSION = "1"
FEATURE_KINDS = {"categorical": "sequence", "list": "token_bag"}  # encoder kind -> the feature's table kind


def write_item_encoder(
    root: Path, weights: Mapping[str, np.ndarray], metadata: Mapping[str, str], served_queries: Optional[np.ndarray]
) -> None:
    """Write ``root/sparse/item_encoder.safetensors``: ``weights`` {name: float32 array}, the
    encoder's ``metadata`` (``ItemEncoder.metadata``), and the ``served_queries`` [S, d] (S >= 1,
    unit rows; or None) with their mean."""
    meta = {"format_version": ENCODER_FORMAT_VERSION, "item_feature": ITEM_FEATURE, **metadata}
    extra = {}
    if served_queries is not None:
        extra = {MEAN_QUERY: served_queries.mean(0), SERVED_QUERIES: served_queries}
    tensors = {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in {**weights, **extra}.items()}
    write_bytes(root / ITEM_ENCODER, safetensors_bytes(tensors, metadata=meta))


def check_item_encoder(
    root: Path, sparse: SparseManifest, problems: List[Problem]
) -> Optional[Tuple[Dict[str, str], Dict[str, np.ndarray]]]:
    """Read and verify the item encoder against the tables and the item store's features ->
    (metadata, weights), None when the export has none or with problems added."""
    path = root / ITEM_ENCODER
    if not path.is_file():
        return None
    start = len(problems)

    def problem(key: str, message: str) -> None:
        problems.append(Problem(ITEM_ENCODER, key, message))

    read = read_safetensors(root, ITEM_ENCODER, problems)
    if read is None:
        return None
    metadata, weights = read
    if metadata.get("format_version") != ENCODER_FORMAT_VERSION:
        version = metadata.get("format_version")
        problem("format_version", f"unknown format version {version!r}; this reader knows {ENCODER_FORMAT_VERSION}")
        return None
    if metadata.get("item_feature") != ITEM_FEATURE or ITEM_FEATURE not in sparse.features:
        problem("item_feature", f"expected {ITEM_FEATURE!r}, a table feature of the export")
        return None
    try:
        features = json.loads(metadata["features"])
        embedding_dim = int(metadata["embedding_dim"])
        mlp_dims = [int(d) for d in json.loads(metadata["mlp_dims"])]
        if not all(
            isinstance(f["name"], str) and isinstance(f["kind"], str) and isinstance(f["rows"], int) and f["dim"] > 0
            for f in features
        ):
            raise ValueError("each feature needs a name, kind, rows and dim")
    except (KeyError, TypeError, ValueError) as exc:
        problem("metadata", f"expected features, embedding_dim and mlp_dims as ItemEncoder.metadata writes ({exc})")
        return None
    table_dim = sparse.tables[sparse.features[ITEM_FEATURE].table].dim
    if embedding_dim != table_dim:
        problem("embedding_dim", f"{embedding_dim}, but the item table's rows have {table_dim}")
    stored = _stored_features(root)
    width = 0
    for feature in features:
        name, kind, rows, dim = feature.get("name"), feature.get("kind"), feature.get("rows"), feature.get("dim")
        if kind == "popularity":  # derived from the counts, not stored with the items
            if dim != 1 or rows != 0 or not (root / POPULARITY).is_file():
                problem(f"features[{name}]", f"a popularity feature needs dim 1, rows 0 and {POPULARITY}")
        elif name not in stored:
            problem(f"features[{name}]", f"not a feature of the item store ({ITEM_STORE}), which gr items add reads")
        if kind in FEATURE_KINDS:
            entry = sparse.features.get(name)
            expected_kind = FEATURE_KINDS[kind]
            if entry is None or entry.kind != expected_kind or sparse.tables[entry.table].rows != rows:
                problem(f"features[{name}]", f"a {kind} feature needs a {expected_kind} table of {rows} rows")
            bag = weights.get(f"bags.{name}.weight")
            if bag is None or bag.shape != (rows, dim):
                problem(f"bags.{name}.weight", f"expected float32 [{rows}, {dim}]")
        elif kind not in ("dense", "popularity"):
            problem(f"features[{name}]", f"unknown kind {kind!r}; expected categorical, list, dense or popularity")
        width += dim
    for i, (fan_in, fan_out) in enumerate(zip([width, *mlp_dims], [*mlp_dims, embedding_dim])):
        layer = f"mlp.{2 * i}"
        weight, bias = weights.get(f"{layer}.weight"), weights.get(f"{layer}.bias")
        if weight is None or bias is None or weight.shape != (fan_out, fan_in) or bias.shape != (fan_out,):
            problem(layer, f"expected weight [{fan_out}, {fan_in}] and bias [{fan_out}]")
    mean_query = weights.get(MEAN_QUERY)
    if mean_query is not None and (mean_query.shape != (embedding_dim,) or np.linalg.norm(mean_query) > 1 + 1e-5):
        problem(MEAN_QUERY, f"expected [{embedding_dim}] of norm at most 1 (a mean of unit queries)")
    queries = weights.get(SERVED_QUERIES)
    if queries is not None and (
        mean_query is None
        or queries.ndim != 2
        or queries.shape[1:] != (embedding_dim,)
        or len(queries) == 0
        or not np.allclose(np.linalg.norm(queries, axis=1), 1.0, atol=1e-4)
    ):
        problem(SERVED_QUERIES, f"expected [S >= 1, {embedding_dim}] unit rows, beside {MEAN_QUERY}")
    for name, value in weights.items():
        if value.dtype != np.float32 or not np.isfinite(value).all():
            problem(name, "expected finite float32 values")
    return (metadata, weights) if len(problems) == start else None


def _stored_features(root: Path) -> List[str]:
    """The feature names of the export's item store (none when it has none)."""
    path = root / ITEM_STORE
    if not path.is_file():
        return []
    try:
        with safe_open(str(path), framework="numpy") as f:
            return [k for k in f.keys() if k != ITEM_FEATURE and not k.endswith(".offsets")]
    except (SafetensorError, OSError):
        return []  # check_item_store names the problem
