"""``gr evaluate RUN|EXPORT``: the test-split metrics of a training run or of an export.

Both use training's evaluation code (``gr.train.tasks``: RetrievalTask's full-catalogue ranks
with the popularity baseline, RankingTask's AUC / log loss) on the test batches of
``SequenceDataModule``. A RUN is scored by ``load_trained_model`` on the run's data config;
an EXPORT by the serving path (``gr.serving.Ranker``) on the data of ``--config`` (a recipe or
the run's ``config.yaml``; ``--data.KEY VALUE`` overrides either, a new ``data.split_time``
dropping the config's ``data.split_end`` unless one is given too), so a run's metrics and its
export's can be compared: they agree to fp32 tolerance (``tests/test_evaluate.py``).

The data are read with the model's id maps (the run's, or the export's ``sparse/id_maps``), so
data other than the training data (tomorrow's events) keep each id on the row the model trained
for it: events of items the model has no row for are left out (counted in the metrics' data
summary as ``unknown_items``), and side-feature values it never saw read as their unknown id 0.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Dict, List, Optional, Sequence, Tuple

import numpy as np

from gr.commands.train import parse_overrides
from gr.data.config import DataConfig
from gr.data.mappings import IdMap, model_maps
from gr.export.format import ID_MAPS_DIR
from gr.serving.scores import LOGIT_SUFFIX
from gr.train.config import TrainConfig, load_config
from gr.train.run_files import CONFIG_FILE, MAPPINGS_DIR, METRICS_FILE
from gr.utils.atomic import atomic_file, write_json
from gr.utils.cli_errors import run_cli

if TYPE_CHECKING:
    import torch

    from gr.data.datamodule import SequenceDataModule
    from gr.model import GRInput, GROutput
    from gr.serving import Ranker
    from gr.train.tasks import RetrievalTask

EVALUATION_FILE = "evaluation.json"
EXPORT_MARKER = "MANIFEST"


def batch_columns(
    batch: GRInput, features: Optional[Collection[str]] = None
) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """The request columns of every token of ``batch`` (model ids), [T] values each (a list feature:
    T bags of ids), "timestamps" included, and each sequence's common features: B {feature: value}.
    Only the features in ``features``, when given (what an export reads)."""

    def kept(columns: Dict[str, Any]) -> Dict[str, Any]:
        return columns if features is None else {k: v for k, v in columns.items() if k in features}

    seq = kept(batch.sequence_ids.to_dict() if batch.sequence_ids is not None else {})
    bags = kept(batch.token_lists.to_dict() if batch.token_lists is not None else {})
    common = kept(batch.common_ids.to_dict() if batch.common_ids is not None else {})
    assert batch.timestamps is not None  # the data module's batches carry them
    cols: Dict[str, Any] = {f: jt.values().numpy() for f, jt in seq.items()}
    cols.update({f: v.numpy() for f, v in kept(batch.token_dense).items()})
    for f, jt in bags.items():
        bag_offsets, ids = jt.offsets().tolist(), jt.values().numpy()
        cols[f] = [ids[bag_offsets[t] : bag_offsets[t + 1]] for t in range(len(bag_offsets) - 1)]
    cols["timestamps"] = batch.timestamps.numpy()
    commons = []
    for b in range(len(batch.seq_offsets) - 1):
        values = {f: jt.values()[int(jt.offsets()[b]) : int(jt.offsets()[b + 1])].numpy() for f, jt in common.items()}
        values.update({f: v[b].numpy() for f, v in kept(batch.common_dense).items()})
        commons.append(values)
    return cols, commons


def batch_requests(
    batch: GRInput, prefix: str = "user", features: Optional[Collection[str]] = None
) -> List[Dict[str, Any]]:
    """One serving request per sequence of ``batch`` (model ids): history = its non-target tokens,
    candidates = its ``num_targets`` trailing tokens (none when ``num_targets`` is None), the
    sequence's common features (``batch_columns``: only those in ``features``, when given);
    user ids ``f"{prefix}{b}"``. A list feature gives each token its bag."""
    cols, commons = batch_columns(batch, features)
    offsets = batch.seq_offsets.tolist()
    num_targets = [0] * (len(offsets) - 1) if batch.num_targets is None else batch.num_targets.tolist()
    out = []
    for b, targets in enumerate(num_targets):
        start, end = offsets[b], offsets[b + 1]
        split = end - targets
        out.append(
            {
                "user_id": f"{prefix}{b}",
                "history": {f: v[start:split] for f, v in cols.items()},
                "candidates": {f: v[split:end] for f, v in cols.items()},
                "common_features": commons[b],
            }
        )
    return out


def evaluate_run(
    run_dir: str | Path, data_overrides: Sequence[Tuple[str, str]] = (), per_user: Optional[Path] = None
) -> Dict[str, Any]:
    """The run's best checkpoint on its test split (data as in the run's config.yaml plus overrides);
    with ``per_user``, each user's metrics are written there too (``write_user_metrics``)."""
    # The training stack (torch, Lightning): imported to evaluate, never to parse gr evaluate's arguments.
    import torch

    from gr.train.run import load_trained_model, run_popularity

    config = load_config(Path(run_dir) / CONFIG_FILE, with_new_cut(data_overrides))
    _check_test_split(config)
    _check_per_user(config, per_user)
    model, _ = load_trained_model(run_dir)
    data = _data(config.data, config.model.hstu.eviction_block, model_maps(str(Path(run_dir) / MAPPINGS_DIR)))
    tower = model.item_tower
    if tower is not None:  # the items' features come from the data, as in training
        tower.set_items(data.item_features.columns(), run_popularity(run_dir))
    task = _task(
        config,
        data,
        model.postfix_dnn.item_embedding if config.task_type == "retrieval" else None,
        None if tower is None else tower.item_vectors,
    )
    task.start_evaluation(model.embeddings)
    popularity = data.popularity() if config.task_type == "retrieval" else None
    with torch.no_grad():
        for batch in data.test_dataloader():
            task.evaluation_step(model(batch), batch, popularity)
    return _report(task, "run", run_dir, data, per_user)


def evaluate_export(
    export_dir: str | Path,
    config_path: str | Path,
    data_overrides: Sequence[Tuple[str, str]] = (),
    per_user: Optional[Path] = None,
) -> Dict[str, Any]:
    """The export's test metrics through ``Ranker`` on the data of ``config_path`` (+ overrides).
    Features of the data that the export does not read are left out of its requests."""
    # The serving runtime (torch, ONNX Runtime): imported to evaluate, never to parse gr evaluate's arguments.
    import torch

    from gr.jagged import offsets_from_lengths
    from gr.serving import Ranker, RankRequest

    config = load_config(config_path, with_new_cut(data_overrides))
    _check_test_split(config)
    _check_per_user(config, per_user)
    ranker = Ranker.load(export_dir, page_size=0)  # each history is encoded once: no page pool to copy it into
    schema = ranker.model.schema
    reads = {*schema.token_features, *schema.common_ids, *schema.common_dense}
    maps = Path(export_dir) / ID_MAPS_DIR
    data = _data(config.data, ranker.model.config.eviction_block, model_maps(str(maps)) if maps.is_dir() else {})
    task = _task(config, data, None)
    if config.task_type == "retrieval":
        catalogue, _ = ranker.catalogue()
        task.catalogue, task.ranks = catalogue.vectors[: data.num_items], {}  # what start_evaluation embeds
        popularity = data.popularity()
    for i, batch in enumerate(data.test_dataloader()):
        if config.task_type == "retrieval":
            task.evaluate_queries(served_queries(ranker, batch, reads, prefix=f"b{i}:"), batch, popularity)
        else:
            results = ranker.rank([RankRequest(**r) for r in batch_requests(batch, prefix=f"b{i}:", features=reads)])
            logits = {
                t: torch.from_numpy(np.concatenate([r.scores[f"{t}{LOGIT_SUFFIX}"] for r in results]))
                for t in task.tasks
            }
            task.evaluation_step(_output(logits, offsets_from_lengths(batch.num_targets)), batch)
    return _report(task, "export", export_dir, data, per_user)


def with_new_cut(data_overrides: Sequence[Tuple[str, str]]) -> List[Tuple[str, str]]:
    """The overrides, plus ``data.split_end null`` when they give a new cut (``data.split_time``)
    and no end: the config's end belongs to its own cut (the training data's), not to later data."""
    keys = {key for key, _ in data_overrides}
    if "data.split_time" in keys and "data.split_end" not in keys:
        return [*data_overrides, ("data.split_end", "null")]
    return list(data_overrides)


def _check_test_split(config: TrainConfig) -> None:
    if not config.data.validates:
        raise ValueError(
            "data.split: 'none' holds no test events out (every event trained); evaluate on later events "
            "with --data.split time --data.split_time SECONDS (and --data.path of the later data)"
        )


def _check_per_user(config: TrainConfig, per_user: Optional[Path]) -> None:
    if per_user is not None and config.task_type != "retrieval":
        raise ValueError(
            f"--per-user {per_user}: per-user metrics are for retrieval (each user's targets ranked in the "
            f"catalogue); this model's task is {config.task_type} (its per-user view is the metrics' GAUC)"
        )


def write_user_metrics(path: Path, task: RetrievalTask, user_map: IdMap) -> None:
    """A CSV at ``path``: ``user,targets,hr@10,...,mrr``, one row per evaluated user (raw user id,
    its number of test targets, the mean of each metric over them), users in dense id order."""
    users, targets, metrics = task.user_metrics()
    raw = user_map.decode(users.numpy()).tolist()
    with atomic_file(path) as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["user", "targets", *metrics])
        writer.writerows(zip(raw, targets.tolist(), *(value.tolist() for value in metrics.values())))


def served_queries(
    ranker: Ranker, batch: GRInput, features: Optional[Collection[str]] = None, prefix: str = "user"
) -> torch.Tensor:
    """[S, d] the served retrieval query of each held-out item of the batch (a retrieval evaluation
    batch: no candidates), at its query token (``gr.train.tasks.query_rows``: a sequence may hold
    several), each at the time of the event after it: the batch's histories validated at once
    (``Ranker.histories``: user ids ``f"{prefix}{b}"``, the request features in ``features`` when
    given) and encoded in shared passes (``gr.serving.encode``), the user cache left alone."""
    from gr.serving import encode as encoding  # loaded by evaluate_export
    from gr.train.tasks import query_rows

    assert batch.num_targets is None  # retrieval evaluation batches: every token is history
    times = batch.timestamps if batch.query_times is None else batch.query_times
    assert times is not None  # the data module's batches carry them
    offsets = batch.seq_offsets.numpy()
    rows = query_rows(batch).numpy()
    sequences = np.searchsorted(offsets[1:], rows, side="right")
    positions = np.split(rows - offsets[sequences], np.cumsum(np.bincount(sequences, minlength=len(offsets) - 1))[:-1])
    columns, commons = batch_columns(batch, features)
    users = [f"{prefix}{b}" for b in range(len(commons))]
    histories = ranker.histories(users, columns, offsets, commons)
    assert not any(h.truncated for h in histories)  # evaluation windows fit max_seq_len
    return encoding.token_queries(histories, positions, [int(t) for t in times[offsets[1:] - 1].tolist()])


def _output(predictions: Dict[str, torch.Tensor], row_offsets: torch.Tensor) -> GROutput:
    """A GROutput of served predictions {name: [N, ...]} with their row offsets [B+1]: what the
    tasks' ``evaluation_step`` reads (no hidden states or features)."""
    import torch  # loaded by evaluate_export

    from gr.model import GROutput

    first = next(iter(predictions.values()))
    return GROutput(predictions, first.new_zeros(0), torch.zeros(0, dtype=torch.long), row_offsets, {}, {})


def _data(config: DataConfig, eviction_block: int, maps: Dict[str, IdMap]) -> SequenceDataModule:
    """The data read with the model's id ``maps``, so that every id keeps the row the model trained;
    events of items the model has no row for are left out (``SequenceDataModule``'s new_ids)."""
    from gr.data.datamodule import SequenceDataModule  # loaded by evaluate_run / evaluate_export

    data = SequenceDataModule(config, eviction_block, maps, new_ids="unknown")
    data.setup()
    return data


def _task(config: TrainConfig, data: SequenceDataModule, item_embedding: Any, item_vectors: Any = None) -> Any:
    from gr.train.tasks import RankingTask, RetrievalTask  # loaded by evaluate_run / evaluate_export

    if config.task_type == "retrieval":
        return RetrievalTask(config.task.retrieval, data.num_items, item_embedding, item_vectors)
    return RankingTask(config.task.ranking, data.tasks)


def _report(
    task: Any, kind: str, source: str | Path, data: SequenceDataModule, per_user: Optional[Path]
) -> Dict[str, Any]:
    """The task's test metrics in metrics.json's layout: {metric: value, "popularity": {...},
    "source": ..., "data": summary}; with ``per_user``, its users' metrics written there first."""
    if per_user is not None:
        assert data.user_map is not None  # set by setup()
        write_user_metrics(per_user, task, data.user_map)
    test = task.finish_evaluation()
    out: Dict[str, Any] = {k: v for k, v in test.items() if not k.startswith("popularity/")}
    baseline = {k.split("/", 1)[1]: v for k, v in test.items() if k.startswith("popularity/")}
    if baseline:
        out["popularity"] = baseline
    out.update({"split": "test", "source": {kind: str(source)}, "data": data.summary})
    return out


def first_event_ranks(source: str | Path, data: DataConfig) -> Dict[str, np.ndarray]:
    """Each user of ``data``'s first event, ranked over the whole catalogue from the user's common
    features alone, by the new-user query (``task.retrieval.new_user_query``) and by popularity.

    source: an export, or a run (exported to a temporary directory first). The data are read with
    the model's id maps, as ``gr evaluate`` reads them: a user's first event is its first event of
    an item the model has a row for, and side-feature values the model never saw read as their
    unknown id 0; no item is excluded from the ranking. -> {"user": [U] int64 the users' dense ids
    in the data, "item": [U] int64 their first items (model ids), "new_user" and "popularity":
    [U] int64 0-based ranks (``gr.train.metrics.target_ranks``: ties by item id);
    ``gr.train.metrics.target_metrics`` turns ranks into HR@k / NDCG@k}. ValueError when the model
    has no new-user state (``hstu/empty_history.safetensors``) or no item popularity."""
    import tempfile

    from gr.export.writer import export_run

    source = Path(source)
    if is_export(source):
        return _first_event_ranks(source, data)
    with tempfile.TemporaryDirectory(prefix="gr-first-events-") as tmp:
        return _first_event_ranks(export_run(source, Path(tmp) / "export"), data)


def _first_event_ranks(export_dir: Path, data_config: DataConfig) -> Dict[str, np.ndarray]:
    import torch

    from gr.serving.model import ServingModel
    from gr.train.metrics import score_ranks, target_ranks

    model = ServingModel(export_dir)
    if model.empty_history is None or model.popularity is None:
        raise ValueError(
            f"{export_dir}: scoring first events needs the new-user state and item popularity "
            "(an export of a run trained with task.retrieval.new_user_query)"
        )
    maps = export_dir / ID_MAPS_DIR
    data = _data(data_config, model.config.eviction_block, model_maps(str(maps)) if maps.is_dir() else {})
    corpus = data.corpus
    assert corpus is not None  # set by setup()
    sequences = corpus.sequences
    users = np.flatnonzero(sequences.offsets[1:] > sequences.starts)
    items = sequences.items[sequences.starts[users]]
    dataset_users = corpus.dataset_users(users)
    side, schema = corpus.user_features, model.schema
    commons = []
    for u in dataset_users:
        common = {name: side.categorical[name][u : u + 1] for name in schema.common_ids if name in side.categorical}
        common.update(
            {name: side.lists[name].take(np.array([u])).values for name in schema.common_ids if name in side.lists}
        )
        common.update({name: side.dense[name][u : u + 1] for name in schema.common_dense})
        commons.append(common)
    targets = torch.from_numpy(items)
    none = (torch.zeros(len(users) + 1, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    catalogue = model.catalogue()
    queries = model.new_user_queries(commons).to(catalogue.vectors.dtype)
    popularity = torch.from_numpy(model.popularity).double().expand(len(users), -1)
    return {
        "user": dataset_users.astype(np.int64),
        "item": items.astype(np.int64),
        "new_user": target_ranks(queries, catalogue.vectors.cpu(), targets, *none).numpy(),
        "popularity": score_ranks(popularity, targets, *none).numpy(),
    }


def is_export(path: Path) -> bool:
    return (path / EXPORT_MARKER).is_file()


def default_output(path: Path) -> Path:
    """RUN/evaluation.json (beside its metrics.json); EXPORT.evaluation.json beside an export
    (an export directory holds only what its MANIFEST lists)."""
    return path.with_name(f"{path.name}.{EVALUATION_FILE}") if is_export(path) else path / EVALUATION_FILE


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_cli("gr evaluate", lambda: _main(sys.argv[1:] if argv is None else list(argv)))


def _main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="gr evaluate",
        description="Test-split metrics of a run (its best checkpoint) or of an export (through the serving "
        "runtime), with training's evaluation code. An export needs the data: --config (a recipe or the run's "
        f"config.yaml); --data.KEY VALUE overrides the data section either way (e.g. --data.path DIR). Writes "
        f"RUN/{EVALUATION_FILE} or EXPORT.{EVALUATION_FILE} unless --output is given.",
    )
    parser.add_argument("source", type=Path, metavar="RUN|EXPORT")
    parser.add_argument("--config", type=Path, help="recipe YAML whose data section the export is evaluated on")
    parser.add_argument(
        "--output", type=Path, help=f"JSON file to write (default: beside the source, {METRICS_FILE}-style)"
    )
    parser.add_argument(
        "--per-user",
        type=Path,
        metavar="FILE.csv",
        help="retrieval: also write each test user's metrics (user,targets,hr@10,...,mrr), for paired comparisons",
    )
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(parser, rest)
    bad = [key for key, _ in overrides if not key.startswith("data.")]
    if bad:
        parser.error(f"only data.* keys can be overridden (the model is fixed), got {['--' + k for k in bad]}")
    if not args.source.is_dir():
        raise NotADirectoryError(f"{args.source}: no such run or export directory")
    if is_export(args.source):
        if args.config is None:
            parser.error(f"{args.source} is an export: --config RECIPE.yaml is needed to read its test data")
        report = evaluate_export(args.source, args.config, overrides, args.per_user)
    else:
        if args.config is not None:
            parser.error("--config is for exports; a run is evaluated on its own config.yaml (use --data.KEY VALUE)")
        if not (args.source / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"{args.source}: neither a run ({CONFIG_FILE}) nor an export ({EXPORT_MARKER})")
        report = evaluate_run(args.source, overrides, args.per_user)
    output = args.output or default_output(args.source)
    write_json(output, report)
    print(json.dumps({k: v for k, v in report.items() if k != "data"}, indent=2))
    print(f"wrote {output}" + (f" and {args.per_user}" if args.per_user else ""))
    return 0
