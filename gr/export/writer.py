"""Write the sliced export of a trained GRModel (format in ``gr.export.format``)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import onnx
import onnxruntime as ort
import torch
import torch.nn.functional as F
from safetensors.torch import save as safetensors_bytes
from torch import Tensor, nn

from gr.data.config import DataConfig
from gr.data.datamodule import SequenceDataModule
from gr.data.mappings import model_maps
from gr.export.delta import write_delta
from gr.export.format import (
    BAG,
    BATCH,
    BATCH_OFFSETS,
    HSTU_CONFIG,
    HSTU_INPUT,
    HSTU_OUTPUT,
    HSTU_SLICE,
    HSTU_WEIGHTS,
    ID_MAPS_DIR,
    NUM_TARGETS,
    POSTFIX,
    POSTFIX_HIDDEN,
    POSTFIX_ONNX,
    PREFIX,
    PREFIX_ONNX,
    PREFIX_OUTPUT,
    REPEAT_PER_TARGET,
    SEQ_OFFSETS,
    SLICE_ENGINES,
    SLICE_GRAPH,
    SOURCE,
    SPARSE,
    SPARSE_DIR,
    SPARSE_INI,
    TABLE_TENSOR,
    TARGETS,
    TIMESTAMPS,
    TOKEN_BAGS,
    TOKENS,
    ExportError,
    ExportFormatError,
    write_ini,
)
from gr.export.hstu_slice import SLICE_DTYPES, slice_config, slice_tensor_shapes, to_slice
from gr.export.item_encoder import write_item_encoder
from gr.export.item_store import ITEM_FEATURE, Column, write_item_store
from gr.export.manifest import write_manifest
from gr.export.new_item_rows import MEAN_QUERY_SAMPLE
from gr.export.new_user import write_empty_history
from gr.export.onnx_graph_cache import CachedGraph
from gr.export.onnx_registry import registry_built_once
from gr.export.popularity import write_popularity
from gr.export.reader import ONNX_DTYPES, check_export
from gr.export.slice_graph import CANDIDATES_OPTIONAL, REQUEST, SliceGraph, SliceSpec, TensorSpec
from gr.export.sparse_manifest import TOKEN_KINDS, FeatureEntry, SparseManifest, TableEntry
from gr.model import GRModel
from gr.postfix_dnn import PostfixDNN
from gr.prefix_dnn import PrefixDNN, check_token_wise
from gr.sparse.touched import rows_since
from gr.train.checkpoint import checkpoint_source, read_meta
from gr.train.config import load_config
from gr.train.module import TOUCHED_ROWS
from gr.train.run import MAPPINGS_DIR, best_checkpoint, load_trained_model, read_run, run_popularity
from gr.train.run_files import CONFIG_FILE, INIT_FROM_FILE
from gr.train.tasks import query_rows
from gr.utils.atomic import atomic_directory, write_bytes, write_json
from gr.utils.outputs import checked_output
from gr.utils.run_lock import run_lock

log = logging.getLogger(__name__)
EXAMPLE_ROWS = 3  # rows of the example inputs traced for ONNX (>= 2: 0/1 sizes get specialised)
VERIFY_ROWS = (1, 5)  # row counts at which ONNX Runtime is checked against PyTorch after export
VERIFY_ATOL = 1e-4
REQUEST_TENSORS = (TIMESTAMPS, SEQ_OFFSETS, NUM_TARGETS)  # request tensors besides the features
STAGING_FULL, STAGING_DELTA = "full", "delta"  # where export_model(base=...) writes, inside its temporary directory


def export_model(
    model: GRModel,
    export_dir: Union[str, Path],
    *,
    id_mappings_dir: Union[str, Path, None] = None,
    dense_dims: Optional[Mapping[str, int]] = None,
    event_features: Sequence[str] = (),
    overwrite: bool = False,
    hstu_dtype: str = "float32",
    item_features: Optional[Mapping[str, Column]] = None,
    popularity: Optional[np.ndarray] = None,
    served_queries: Optional[np.ndarray] = None,
    source: Optional[Mapping[str, Any]] = None,
    base: Union[str, Path, None] = None,
    touched: Optional[Mapping[str, np.ndarray]] = None,
    keep_full: Optional[Path] = None,
) -> Path:
    """Write ``model``'s sliced export to ``export_dir`` atomically and validate it.

    model: an unsharded GRModel (``gr.train.load_trained_model`` returns one). With an item tower
        (``model.item_tower``), its items' features given (``ItemTower.set_items``): the item
        table is written as the tower's item vectors, and the encoder beside it
        (``gr.export.item_encoder``)

    id_mappings_dir: a directory from ``SequenceDataModule.save_mappings``, copied to
        ``sparse/id_maps/``; the map named after a feature, its table, or ``<name>s`` for
        a feature ``<name>_id`` (item_id -> items) becomes its ``id_mapping`` in sparse.ini.
    dense_dims: {feature: dim} of dense token/common features the DNNs read (features
        without a table); defaults to the DNN's own ``feature_dims``/``common_dims`` when it has them.
    event_features: token features of the interaction itself (``FeatureSpec.event_features``):
        marked ``candidates = optional`` in the request schema (candidates take id 0 / zeros).
    overwrite: replace an existing export_dir (otherwise it is an error).
    hstu_dtype: "float32" or "bfloat16": how ``hstu/model.safetensors`` stores the weights
    (the runtime computes in float32 either way).
    item_features: {token feature: [items] int64 ids | [items, d] float32 | JaggedRows of items
        rows of int64 ids (a list feature)}, row i the item features of model item i: written
        to the export's item store (``gr.export.item_store``),
        from which serving fills them for items a request gives by id alone.
    popularity: [item table rows] training counts of each item (``gr.data.popularity``), written to
        ``sparse/popularity.safetensors``: serving's answer to an empty history (``gr.export.popularity``).
    served_queries: with an item tower, [S, d] normalised served queries (``served_query_sample``),
        written with their mean beside the encoder: where ``gr items add`` places new items
        (``gr.export.new_item_rows``).
    The model's ``empty_history``, when it has one, is written to ``hstu/empty_history.safetensors``:
    serving's answer to an empty history with the user's common features (``gr.export.new_user``).
    source: where the model came from (``export_run``: the run, its checkpoint, epoch and step),
        written to ``source.json`` and hashed in the MANIFEST with every other file.
    base: a full export of an earlier version of this model: ``export_dir`` is then the delta
        from it (``gr.export.delta``; the full export is written and checked first, beside the
        delta, and removed). A ``base`` of another model is a ValueError naming what differs.
    touched: with ``base``, {table: row ids} training updated since ``base`` was taken: only
        those rows of those tables are compared (``gr.export.delta.write_delta``).
    keep_full: with ``base``, a new directory where the full export the delta was taken from
        is left (a publisher's next base), instead of being removed.
    """
    if hstu_dtype not in SLICE_DTYPES:
        raise ValueError(f"hstu_dtype: expected one of {list(SLICE_DTYPES)}, got {hstu_dtype!r}")
    if not isinstance(model, GRModel):
        raise TypeError(f"export_model: expected a GRModel, got {type(model).__name__}")
    export_dir = Path(export_dir)
    was_training = model.training
    model.eval()
    try:
        with atomic_directory(export_dir, command="gr export", overwrite=overwrite) as tmp:
            full = tmp if base is None else keep_full or tmp / STAGING_FULL
            full.mkdir(exist_ok=True)
            sparse = _write(
                model,
                full,
                id_mappings_dir,
                dict(dense_dims or {}),
                tuple(event_features),
                hstu_dtype,
                item_features,
                served_queries,
            )
            if popularity is not None:
                write_popularity(full, popularity, sparse)
            if source is not None:
                write_json(full / SOURCE, dict(source))
            write_manifest(full)
            problems = check_export(full)
            if problems:
                raise ExportFormatError(problems)
            if base is not None:
                delta = tmp / STAGING_DELTA
                delta.mkdir()
                write_delta(base, full, delta, touched)
                if keep_full is None:
                    shutil.rmtree(full)
                for entry in list(delta.iterdir()):
                    entry.rename(tmp / entry.name)
                delta.rmdir()
    finally:
        model.train(was_training)
    return export_dir


def export_run(
    run_dir: Union[str, Path],
    export_dir: Union[str, Path],
    *,
    overwrite: bool = False,
    hstu_dtype: str = "float32",
    base: Union[str, Path, None] = None,
) -> Path:
    """Export a training run's best checkpoint (all shards merged) with its id mappings, naming
    the run and that checkpoint in the export's ``source.json``. base: an export of this run or
    of a run it was warm-started from (``trainer.init_from``, followed back): ``export_dir`` is
    the delta from it (``export_model``), which reads only the rows the run recorded updating
    since ``base`` was taken where it can (``tracked_rows``); an export of another run is a
    ValueError naming both.

    Dense feature dims come from the run's ``features.json``; mappings from ``mappings/``; the item
    features the model reads from the run's training data (``gr.export.item_store``). The run
    is read under its lock, shared (``gr.utils.run_lock``): a run being trained or resumed is refused,
    as is an ``export_dir`` that is, holds or lies inside the run or its data (``gr.utils.outputs``).
    """
    run_dir = Path(run_dir)
    with run_lock(run_dir, "gr export", shared=True):
        config, _, _ = read_run(run_dir)
        checked_output(export_dir, [("RUN_DIR", run_dir), *config.data.inputs()], "EXPORT_DIR")
        if base is not None:
            check_lineage(run_dir, Path(base))
        return export_checkpoint(
            run_dir, best_checkpoint(run_dir), export_dir, overwrite=overwrite, hstu_dtype=hstu_dtype, base=base
        )


def export_checkpoint(
    run_dir: Path,
    checkpoint: Path,
    export_dir: Union[str, Path],
    *,
    overwrite: bool = False,
    hstu_dtype: str = "float32",
    base: Union[str, Path, None] = None,
    keep_full: Optional[Path] = None,
) -> Path:
    """``export_run`` of one ``checkpoint`` of the run, unlocked and unchecked (the caller holds
    the run, or is its training); keep_full as ``export_model`` takes it."""
    _, spec, _ = read_run(run_dir)
    model, _ = load_trained_model(run_dir, checkpoint)
    mappings = run_dir / MAPPINGS_DIR
    data = run_data(run_dir, "an item tower") if model.item_tower is not None else None
    item_features = run_item_features(run_dir, model.prefix_dnn.feature_names, data)
    popularity = run_popularity(run_dir)
    served_queries = None
    if data is not None:  # an item tower: its items' features and counts, then the queries it serves
        assert model.item_tower is not None
        model.item_tower.set_items(item_features, popularity)
        served_queries = served_query_sample(model, data)
    touched = None
    if base is not None:
        touched, why = tracked_rows(run_dir, checkpoint, Path(base))
        if touched is not None and model.embeddings is not None and model.item_tower is not None:
            # the tower's table is exported as its item vectors: a step of its encoder moves every row
            item, tables = model.item_tower.item_feature, model.embeddings.tables
            touched = {t: ids for t, ids in touched.items() if item not in tables[t].features}
        log.info("delta rows: %s", why if touched is None else f"tracked by training for tables {sorted(touched)}")
    return export_model(
        model,
        export_dir,
        id_mappings_dir=mappings if mappings.is_dir() else None,
        dense_dims={**spec.token_dense, **spec.common_dense},
        event_features=spec.event_features,
        overwrite=overwrite,
        hstu_dtype=hstu_dtype,
        item_features=item_features,
        popularity=popularity,
        served_queries=served_queries,
        source=checkpoint_source(run_dir, checkpoint),
        base=base,
        touched=touched,
        keep_full=keep_full,
    )


def tracked_rows(run_dir: Path, checkpoint: Path, base: Path) -> Tuple[Optional[Dict[str, np.ndarray]], str]:
    """({table: row ids} the run's training updated between the model ``base`` (an export) holds
    and ``checkpoint``'s, "") when the run recorded them (``trainer.track_rows``, or publishing)
    from a point no later than ``base``: ``base`` is an export of this run, or of the checkpoint
    it was warm-started from. Otherwise (None, why the tables are compared whole)."""
    saved = read_meta(checkpoint).get(TOUCHED_ROWS)
    if saved is None:
        return None, f"compared whole tables ({checkpoint} holds no record of the rows training updated)"
    source = json.loads((base / SOURCE).read_text()) if (base / SOURCE).is_file() else {}
    origin = json.loads((run_dir / INIT_FROM_FILE).read_text()) if (run_dir / INIT_FROM_FILE).is_file() else {}
    if source.get("run") == str(run_dir.resolve()):
        step = int(source.get("global_step") or 0)
    elif source and (source.get("run"), source.get("checkpoint")) == (origin.get("run"), origin.get("checkpoint")):
        step = 0  # the weights this run started from
    else:
        return None, f"compared whole tables (the base {base} is neither an export of this run nor of its warm start)"
    try:
        return rows_since(saved, step), ""
    except ValueError as exc:
        return None, f"compared whole tables ({checkpoint}: {exc})"


def check_lineage(run_dir: Path, base: Path) -> None:
    """ValueError unless the run that ``base`` (an export) names in its ``source.json`` is
    ``run_dir`` or one it was warm-started from (``trainer.init_from``, followed back). An export
    without ``source.json`` (``export_model`` of a model) names no run: nothing to check."""
    source = base / SOURCE
    if not source.is_file():
        return
    origin = Path(str(json.loads(source.read_text()).get("run", ""))).resolve()
    chain: List[Path] = []
    run: Optional[Path] = run_dir.resolve()
    while run is not None and run not in chain:
        chain.append(run)
        if run == origin:
            return
        init_from = load_config(run / CONFIG_FILE).trainer.init_from if (run / CONFIG_FILE).is_file() else None
        run = None if init_from is None else Path(init_from).resolve()
    raise ValueError(
        f"--base {base}: an export of the run {origin}, which is neither {run_dir} nor a run it was warm-started "
        f"from (its runs: {' <- '.join(map(str, chain))}); a delta applies only to an earlier export of its model"
    )


def _write(
    model: GRModel,
    root: Path,
    id_mappings_dir: Union[str, Path, None],
    dense_dims: Dict[str, int],
    event_features: Tuple[str, ...],
    hstu_dtype: str,
    item_features: Optional[Mapping[str, Column]],
    served_queries: Optional[np.ndarray],
) -> SparseManifest:
    prefix, postfix, config = model.prefix_dnn, model.postfix_dnn, model.hstu.config
    sparse = _write_sparse(model, root, id_mappings_dir)
    token_dims = _feature_dims(prefix, prefix.feature_names, sparse, TOKEN_KINDS, dense_dims, "feature_dims")
    if item_features:
        write_item_store(root, item_features, token_dims, sparse, event_features)
    if model.item_tower is not None:
        encoder = model.item_tower.encoder
        weights = {name: value.detach().float().cpu().numpy() for name, value in encoder.state_dict().items()}
        write_item_encoder(root, weights, encoder.metadata(), served_queries)
    common_dims = _feature_dims(postfix, postfix.common_feature_names, sparse, ("common",), dense_dims, "common_dims")
    _check_names(prefix, postfix)

    prefix_inputs = {name: torch.randn(EXAMPLE_ROWS, dim) for name, dim in token_dims.items()}
    _check_prefix_token_wise(prefix, prefix_inputs)
    prefix_out = _export_onnx(
        "prefix_dnn",
        prefix,
        _PrefixAdapter(prefix).eval(),
        tuple(prefix_inputs.values()),
        list(token_dims),
        [PREFIX_OUTPUT],
        TOKENS,
        root / PREFIX_ONNX,
    )
    if prefix_out[0].shape != (TOKENS, config.hidden_dim):
        raise ExportError(
            f"prefix_dnn ({type(prefix).__name__}): output shape {list(prefix_out[0].shape)}, "
            f"HSTU expects [{TOKENS}, {config.hidden_dim}] (HSTUConfig.hidden_dim)"
        )
    postfix_inputs = {POSTFIX_HIDDEN: torch.randn(EXAMPLE_ROWS, config.hidden_dim)}
    postfix_inputs.update({name: torch.randn(EXAMPLE_ROWS, dim) for name, dim in common_dims.items()})
    postfix_out = _export_onnx(
        "postfix_dnn",
        postfix,
        _PostfixAdapter(postfix).eval(),
        tuple(postfix_inputs.values()),
        list(postfix_inputs),
        list(postfix.output_names),
        TARGETS,
        root / POSTFIX_ONNX,
    )

    (root / "hstu").mkdir()
    write_json(root / HSTU_CONFIG, slice_config(config, hstu_dtype))
    weights = to_slice(model.hstu.state_dict(), config, hstu_dtype)
    expected = slice_tensor_shapes(config)
    if {n: tuple(t.shape) for n, t in weights.items()} != expected:
        raise ExportError(
            f"HSTU slice names/shapes {sorted(weights)} differ from the documented export schema "
            f"{sorted(expected)} (gr.export.hstu_slice.slice_tensor_shapes)"
        )
    write_bytes(root / HSTU_WEIGHTS, safetensors_bytes(weights))
    if model.empty_history is not None:
        write_empty_history(root, model.empty_history)

    graph = _slice_graph(model, sparse, token_dims, common_dims, prefix_out, postfix_out, event_features)
    write_ini(root / SLICE_GRAPH, graph.to_sections(), header="gr slice graph: slices in execution order")
    return sparse


def _write_sparse(model: GRModel, root: Path, id_mappings_dir: Union[str, Path, None]) -> SparseManifest:
    (root / SPARSE_DIR).mkdir()
    mapping_files: Dict[str, str] = {}
    if id_mappings_dir is not None:
        source = Path(id_mappings_dir)
        if not source.is_dir():
            raise FileNotFoundError(f"id_mappings_dir: {source} is not a directory")
        shutil.copytree(source, root / ID_MAPS_DIR)
        mapping_files = _mapping_files(root / ID_MAPS_DIR)
    tables: Dict[str, TableEntry] = {}
    features: Dict[str, FeatureEntry] = {}
    embeddings, tower = model.embeddings, model.item_tower
    for table in embeddings.tables.values() if embeddings is not None else ():
        assert embeddings is not None  # the loop runs over its tables
        weight = embeddings.table_weight(table.name)  # [rows, embedding_dim], storage padding cut off
        if tower is not None and tower.item_feature in table.features:  # the items as the model embeds them
            with torch.no_grad():
                weight = tower.item_vectors(torch.arange(weight.shape[0], device=weight.device), weight)
        file = f"{table.name}.safetensors"
        rows = weight.detach().to(torch.float32).contiguous()
        (root / SPARSE_DIR / file).write_bytes(safetensors_bytes({TABLE_TENSOR: rows}))
        tables[table.name] = TableEntry(table.name, file, table.num_embeddings, table.embedding_dim)
        pooling = "none" if table.kind == "sequence" else table.pooling
        for feature in table.features:
            names = (feature, table.name, f"{feature[:-3]}s" if feature.endswith("_id") else feature)
            mapping = next((mapping_files[n] for n in names if n in mapping_files), None)
            features[feature] = FeatureEntry(feature, table.name, table.kind, pooling, mapping)
    manifest = SparseManifest(tables, features)
    manifest.write(root)
    return manifest


def _mapping_files(directory: Path) -> Dict[str, str]:
    """{map name: file relative to sparse/}: from the ``mappings.json`` manifest written by
    ``SequenceDataModule.save_mappings`` when present, else every ``<name>.tsv``."""
    prefix = Path(ID_MAPS_DIR).relative_to(SPARSE_DIR)
    manifest = directory / "mappings.json"
    if manifest.is_file():
        maps = json.loads(manifest.read_text()).get("maps", {})
        return {name: str(prefix / entry["file"]) for name, entry in maps.items()}
    return {p.name[: -len(".tsv")]: str(prefix / p.name) for p in sorted(directory.glob("*.tsv"))}


def _feature_dims(
    module: nn.Module,
    names: Sequence[str],
    sparse: SparseManifest,
    kinds: Tuple[str, ...],
    dense_dims: Dict[str, int],
    attr: str,
) -> Dict[str, int]:
    """{feature: dim} for the features a DNN reads: table dims for ids, given dims for dense ones."""
    own = dict(getattr(module, attr, None) or {})
    dims = {}
    for name in names:
        feature = sparse.features.get(name)
        if feature is not None:
            if feature.kind not in kinds:
                raise ExportError(
                    f"{type(module).__name__} reads {name!r}, a {feature.kind} feature; "
                    f"it can only read {' or '.join(kinds)} features"
                )
            dims[name] = sparse.feature_dim(name)
        elif name in dense_dims or name in own:
            dims[name] = int(dense_dims[name] if name in dense_dims else own[name])
        else:
            raise ExportError(
                f"{type(module).__name__} reads {name!r}, which has no embedding table: "
                f"pass dense_dims={{{name!r}: <dim>}} to export_model"
            )
    return dims


def _check_names(prefix: PrefixDNN, postfix: PostfixDNN) -> None:
    """Tensor names must not collide inside an ONNX graph or among the request tensors."""
    features, common = list(prefix.feature_names), list(postfix.common_feature_names)
    outputs = list(postfix.output_names)
    for owner, names in (
        ("PrefixDNN.feature_names", features),
        ("PostfixDNN.common_feature_names", common),
        ("PostfixDNN.output_names", outputs),
    ):
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise ExportError(f"{owner}: expected distinct non-empty names, got {names}")
    if not outputs:
        raise ExportError(f"{type(postfix).__name__}.output_names is empty: the export needs the task output names")
    clashes = [
        ("PrefixDNN.feature_names", features, (PREFIX_OUTPUT, *REQUEST_TENSORS)),
        ("PostfixDNN.common_feature_names", common, (POSTFIX_HIDDEN, *REQUEST_TENSORS, *features)),
        ("PostfixDNN.output_names", outputs, (POSTFIX_HIDDEN, *common)),
    ]
    for owner, names, taken in clashes:
        clash = [n for n in names if n in taken]
        if clash:
            raise ExportError(f"{owner}: {clash} collide with other tensor names of the export ({sorted(set(taken))})")


def _check_prefix_token_wise(prefix: PrefixDNN, inputs: Dict[str, Tensor]) -> None:
    try:
        check_token_wise(prefix, inputs)
    except Exception as exc:  # AssertionError: not token-wise; anything else: the module fails on such rows
        raise ExportError(
            f"prefix_dnn ({type(prefix).__name__}) is not token-wise (each token's output must "
            f"depend on that token only, or a cached history is wrong): "
            f"{type(exc).__name__}: {exc}"
        ) from exc


class _PrefixAdapter(nn.Module):
    """Positional ONNX signature (one [T, d] tensor per feature) around a PrefixDNN."""

    def __init__(self, prefix: PrefixDNN) -> None:
        super().__init__()
        self.prefix = prefix

    def forward(self, *features: Tensor) -> Tensor:
        return self.prefix(dict(zip(self.prefix.feature_names, features)))


class _PostfixAdapter(nn.Module):
    """Positional ONNX signature (hidden, then one [N, d] tensor per common feature) around a PostfixDNN."""

    def __init__(self, postfix: PostfixDNN) -> None:
        super().__init__()
        self.postfix = postfix

    def forward(self, hidden: Tensor, *common: Tensor) -> Tuple[Tensor, ...]:
        out = self.postfix(hidden, dict(zip(self.postfix.common_feature_names, common)))
        missing = [n for n in self.postfix.output_names if n not in out]
        if missing:
            raise KeyError(f"outputs {missing} (in output_names) were not returned; got {sorted(out)}")
        return tuple(out[name] for name in self.postfix.output_names)


def _export_onnx(
    slice_name: str,
    module: nn.Module,
    adapter: nn.Module,
    example: Tuple[Tensor, ...],
    input_names: List[str],
    output_names: List[str],
    dim_name: str,
    path: Path,
) -> List[TensorSpec]:
    """Export ``adapter`` with a dynamic first dim, check ONNX Runtime against PyTorch; -> output specs.
    An architecture exported before gets its cached graph with these weights (``gr.export.onnx_graph_cache``)."""
    label = f"{slice_name} ({type(module).__qualname__})"
    path.parent.mkdir(parents=True, exist_ok=True)
    dim = torch.export.Dim(dim_name)
    dynamic: Tuple[Any, ...]  # per input: {0: dim}, or a tuple of those for a tuple input
    if isinstance(adapter, _PostfixAdapter) and len(example) > 1:
        dynamic = ({0: dim}, tuple({0: dim} for _ in example[1:]))
    elif isinstance(adapter, _PostfixAdapter):
        dynamic = ({0: dim},)
    else:
        dynamic = (tuple({0: dim} for _ in example),)
    with torch.no_grad():
        cached = CachedGraph.trace(adapter, example, input_names, output_names, dynamic)
    if cached is not None and cached.write(path):
        try:
            return _checked_onnx(label, adapter, example, input_names, output_names, dim_name, path)
        except ExportError:
            cached.discard()
    try:
        with torch.no_grad(), registry_built_once():
            torch.onnx.export(
                adapter if cached is None else cached.program,
                example,
                str(path),
                dynamo=True,
                input_names=input_names,
                output_names=output_names,
                dynamic_shapes=dynamic,
                verbose=False,
                external_data=False,
            )
    except Exception as exc:  # the exporter raises many types; all mean "cannot export this module"
        raise ExportError(f"{label}: ONNX export failed: {type(exc).__name__}: {_first_lines(exc)}") from exc
    specs = _checked_onnx(label, adapter, example, input_names, output_names, dim_name, path)
    if cached is not None:
        cached.keep(path)
    return specs


def _checked_onnx(
    label: str,
    adapter: nn.Module,
    example: Tuple[Tensor, ...],
    input_names: List[str],
    output_names: List[str],
    dim_name: str,
    path: Path,
) -> List[TensorSpec]:
    """The exported model at ``path``: every input and output [dim_name, ...], ONNX Runtime equal to
    PyTorch at each of ``VERIFY_ROWS`` row counts (1 included); -> output specs."""
    model = onnx.load(str(path))
    for value in model.graph.input:
        shape: Sequence[Any] = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
        if not shape or shape[0] != dim_name:
            raise ExportError(
                f"{label}: ONNX export failed: input {value.name!r} got shape {shape}, not "
                f"[{dim_name}, ...]: the traced graph depends on the row count, but the module "
                "must work for any number of rows"
            )
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for rows in VERIFY_ROWS:
        inputs = tuple(torch.randn(rows, *x.shape[1:]) for x in example)
        with torch.no_grad():
            expected = adapter(*inputs)
        expected = expected if isinstance(expected, tuple) else (expected,)
        try:
            got = session.run(output_names, {n: x.numpy() for n, x in zip(input_names, inputs)})
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ExportError(f"{label}: the exported ONNX model fails at {rows} row(s): {_first_lines(exc)}") from exc
        for name, want, have in zip(output_names, expected, got):
            err = float(np.abs(want.numpy() - have).max()) if have.size else 0.0
            if have.shape != tuple(want.shape) or err > VERIFY_ATOL:
                raise ExportError(
                    f"{label}: ONNX Runtime output {name!r} differs from PyTorch at {rows} row(s) "
                    f"(shape {have.shape} vs {tuple(want.shape)}, max abs error {err:.2e})"
                )
    specs = []
    for value in model.graph.output:
        tensor_type = value.type.tensor_type
        shape = tuple(d.dim_param or d.dim_value for d in tensor_type.shape.dim)
        if not shape or shape[0] != dim_name:
            raise ExportError(
                f"{label}: output {value.name!r} has shape {list(shape)}; expected [{dim_name}, ...] "
                "(one row per input row)"
            )
        specs.append(TensorSpec(value.name, ONNX_DTYPES.get(tensor_type.elem_type, str(tensor_type.elem_type)), shape))
    return specs


def _slice_graph(
    model: GRModel,
    sparse: SparseManifest,
    token_dims: Dict[str, int],
    common_dims: Dict[str, int],
    prefix_out: List[TensorSpec],
    postfix_out: List[TensorSpec],
    event_features: Tuple[str, ...],
) -> SliceGraph:
    hidden = model.hstu.config.hidden_dim
    request: List[TensorSpec] = []
    sparse_in: List[TensorSpec] = []
    sparse_out: List[TensorSpec] = []
    prefix_in: List[TensorSpec] = []
    postfix_in = [TensorSpec(POSTFIX_HIDDEN, "float32", (TARGETS, hidden), f"{HSTU_SLICE}.{HSTU_OUTPUT}")]
    for names, dims, rows, out_rows, dest, repeat in (
        (list(token_dims), token_dims, TOKENS, TOKENS, prefix_in, None),
        (list(common_dims), common_dims, BAG, BATCH, postfix_in, REPEAT_PER_TARGET),
    ):
        for name in names:
            dest_rows = TOKENS if dest is prefix_in else TARGETS
            optional = CANDIDATES_OPTIONAL if dest is prefix_in and name in event_features else None
            if name in sparse.features:
                ids = TOKEN_BAGS if sparse.features[name].kind == "token_bag" else (rows,)
                request.append(TensorSpec(name, "int64", ids, candidates=optional))
                sparse_in.append(TensorSpec(name, "int64", ids, f"{REQUEST}.{name}"))
                sparse_out.append(TensorSpec(name, "float32", (out_rows, dims[name])))
                source = f"{SPARSE}.{name}"
            else:
                request.append(TensorSpec(name, "float32", (out_rows, dims[name]), candidates=optional))
                source = f"{REQUEST}.{name}"
            dest.append(TensorSpec(name, "float32", (dest_rows, dims[name]), source, repeat))
    request += [
        TensorSpec(TIMESTAMPS, "int64", (TOKENS,)),
        TensorSpec(SEQ_OFFSETS, "int64", (BATCH_OFFSETS,)),
        TensorSpec(NUM_TARGETS, "int64", (BATCH,)),
    ]
    hstu_in = [
        TensorSpec(HSTU_INPUT, "float32", (TOKENS, hidden), f"{PREFIX}.{PREFIX_OUTPUT}"),
        TensorSpec(TIMESTAMPS, "int64", (TOKENS,), f"{REQUEST}.{TIMESTAMPS}"),
        TensorSpec(SEQ_OFFSETS, "int64", (BATCH_OFFSETS,), f"{REQUEST}.{SEQ_OFFSETS}"),
        TensorSpec(NUM_TARGETS, "int64", (BATCH,), f"{REQUEST}.{NUM_TARGETS}"),
    ]
    slices = (
        SliceSpec(SPARSE, SLICE_ENGINES[SPARSE], (SPARSE_INI,), tuple(sparse_in), tuple(sparse_out)),
        SliceSpec(PREFIX, SLICE_ENGINES[PREFIX], (PREFIX_ONNX,), tuple(prefix_in), tuple(prefix_out)),
        SliceSpec(
            HSTU_SLICE,
            SLICE_ENGINES[HSTU_SLICE],
            (HSTU_CONFIG, HSTU_WEIGHTS),
            tuple(hstu_in),
            (TensorSpec(HSTU_OUTPUT, "float32", (TARGETS, hidden)),),
        ),
        SliceSpec(POSTFIX, SLICE_ENGINES[POSTFIX], (POSTFIX_ONNX,), tuple(postfix_in), tuple(postfix_out)),
    )
    return SliceGraph(tuple(request), slices)


def _first_lines(exc: BaseException, limit: int = 12) -> str:
    """The informative head of an exception message (the summary section of torch.export errors)."""
    text = str(exc)
    summary = "## Exception summary"
    if summary in text:
        text = text.split(summary, 1)[1]
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join(lines[:limit]) + ("\n..." if len(lines) > limit else "")


def run_data(run_dir: Path, reader: str) -> SequenceDataModule:
    """The run's data (``data`` of its config.yaml) set up with the run's maps, as training saw it;
    ExportError naming the run and what ``reader`` (what needs it) when it cannot be read or its items
    differ from the run's."""
    config, _, _ = read_run(run_dir)
    # read with the run's maps: a warm-started run's are extended (new ids after the old), not sorted
    trained_maps = model_maps(str(Path(run_dir) / MAPPINGS_DIR))
    data = SequenceDataModule(config.data, config.model.hstu.eviction_block, trained_maps)
    try:
        data.setup()
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"{run_dir}: the model reads {reader}, which the export takes from the run's training data "
            f"(data.source {config.data.source!r}, {_data_location(config.data)}), and that data cannot be "
            f"read: {exc}"
        ) from exc
    trained = trained_maps.get("items")
    assert data.item_map is not None  # set by setup()
    if trained is None or not np.array_equal(trained.raw, data.item_map.raw):
        raise ExportError(
            f"{run_dir}: the items of {_data_location(config.data)} differ from those the run was trained on "
            f"({MAPPINGS_DIR}/items.tsv): its item features cannot be matched to the model's items"
        )
    return data


def run_item_features(
    run_dir: Path, feature_names: Sequence[str], data: Optional[SequenceDataModule] = None
) -> Dict[str, Column]:
    """The item features among ``feature_names`` (what the prefix_dnn reads) of a training run, read
    from its data (``run_data``, or ``data`` when given) as training saw them: {feature: [items]
    int64 | [items, d] float32 | items rows of int64 ids} by model item id. Empty when the model
    reads none (the data is not read)."""
    _, spec, _ = read_run(run_dir)
    declared = set(spec.sequence) | set(spec.token_lists) | set(spec.token_dense)
    wanted = [f for f in feature_names if f in declared and f != ITEM_FEATURE and f not in spec.event_features]
    if not wanted:
        return {}
    side = (data or run_data(run_dir, f"item features {wanted}")).item_features.columns()
    return {f: side[f] for f in wanted if f in side}


def served_query_sample(model: GRModel, data: SequenceDataModule) -> Optional[np.ndarray]:
    """[S, d] float32 the L2-normalised retrieval queries of the first ``MEAN_QUERY_SAMPLE`` validation
    events of ``data`` (with ``data.split: none``, the queries that end training sequences; None when
    there are none): ``gr.export.new_item_rows``' served queries, and their mean its mean query."""
    queries: List[Tensor] = []
    seen = 0
    loader = data.val_dataloader() if data.config.validates else data.train_dataloader()
    with torch.no_grad():
        for batch in loader:
            query = model(batch).predictions["query"].index_select(0, query_rows(batch))
            queries.append(F.normalize(query.float(), dim=-1)[: MEAN_QUERY_SAMPLE - seen])
            seen += len(queries[-1])
            if seen >= MEAN_QUERY_SAMPLE:
                break
    return torch.cat(queries).numpy().astype(np.float32) if seen else None


def _data_location(data: DataConfig) -> str:
    """Where a run's data is read from, as its config names it: data.prepared, else data.path."""
    return f"data.prepared {data.prepared!r}" if data.prepared is not None else f"data.path {data.path!r}"
