"""Cold-start items and users on MovieLens-100K: items no model trained on, added to its export and scored by
their features; users no model trained on, served from their features.

    python bench/cold_start.py [--epochs 15] [--seed 0] [--held-out 0.1] [--id-dropout 0.2] [--no-year]
                               [--mlp-dims 64] [--feature-loss-weight 1] [--data.path DIR]
                               (ML-100K: $GR_ML100K_DIR or data/ml-100k)
    python bench/cold_start.py --smoke                                 # 1 epoch of 2 steps a run: checks it runs
    python bench/cold_start.py --seed 2 --work DIR   # keeps the runs in DIR; a later call with DIR reuses them

The custom project's model and features (examples/custom_project/config.yaml: genres as a list, user
age, gender and occupation; sparse.backend torch), with the items' release years (``data.release_year``:
an ``item_year`` table read by its GenreEncoder; ``--no-year`` leaves them out), trained twice on the
same data: with an item tower over the genres and years (``model.item_tower: {features: [item_genres,
item_year], id_dropout: --id-dropout, mlp_dims: --mlp-dims, feature_loss_weight: --feature-loss-weight,
popularity: --popularity}``) and without it (items are their rows).
``--held-out`` of the items (every event of theirs removed from training) and of the users (every
event removed; kept for (b)) are drawn by ``--seed``. Both runs are exported and the held-out items
added (``gr items add``: with the tower each row is placed from the encoder of its features (the
trained items nearest it) and its count, ``item_popularity``, the events the popularity baseline
counts (``gr.export.new_item_rows``); without
it zero rows). Then the test: each other user's last event (leave one out, on all of its events, held-out
items included), ranked by the served query over the grown catalogue, the user's earlier items excluded:
  (a) events whose target is a held-out item, ranked among the held-out items: the tower model,
      popularity among them (their counts in the test data's training parts: the events before each
      user's last two), and the model without the tower (zero rows, what ``gr items add`` gives it,
      or the mean trained row alike: every held-out item ties); over the whole catalogue also the
      tower model and the model without it with zero rows and with the mean trained row;
  (b) the held-out users' first events, ranked over the tower model's trained catalogue from their
      user features alone (its new-user query) against popularity: ``bench/new_users.py``'s
      measurement (``first_event_ranks``, ``first_event_metrics``);
  (c) every other event, over the whole catalogue: the tower model against the model without it;
  (a) over more events (``pseudo_cold``): each fifth of the trained items placed in turn as ``gr items
      add`` places new items, from the other four fifths, and the warm events that target them ranked
      among that fifth: the placement, the placement from the items' own feature-only directions (no
      neighbours), and popularity;
and the share of the top-10 slots (whole catalogue, warm users) the held-out items take against
their share of the test targets, with what places them: the mean cosine of the warm users' queries
with the held-out items' and with the trained items' rows, the spread of those cosines (each query's
standard deviation over the items, averaged), each query's best held-out cosine against its tenth
best trained one (the bar of its top 10), and the rows' mean norms.

``--work DIR`` works in DIR instead of a temporary directory and keeps it: a run DIR already holds
(its ``metrics.json``) is not trained again, nor its export (``NAME-export``) written again, so a
later call with the same DIR (the same seed, held-out fraction, epochs and options, checked against
``DIR/arguments.json``) measures ``gr items add`` and the scoring again in minutes (remove the
exports to export the runs again).

Prints each run, then one JSON line: seed, epochs, id_dropout, year, mlp_dims, feature_loss_weight,
held_out (items, users, fractions), events per group, metrics {group: {scorer: {hr@10, ndcg@10,
se_hr@10, se_ndcg@10}}} (SE: the sample standard error of the mean over the group's events),
a_pseudo_cold (``pseudo_cold``), b_new_users (``first_event_metrics``),
paired differences (mean, SE, in SE) for the targets' comparisons, placement, gain_fit (``gr items
add``'s), top10_share_held_out, target_share_held_out, their ratio, targets ((a) tower above
popularity among the held-out items by more than one paired SE in HR@10; (b) the new-user query above
popularity by more than one paired SE in HR@10; (c) tower within one paired SE of no tower or better;
share ratio within [0.5, 2]), train seconds, cpu, cpu_flags, load_average.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import smoke  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from _stats import paired_difference  # noqa: E402
from memory import cpu, load_average  # noqa: E402
from new_users import first_event_metrics, print_first_event_metrics  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from gr.commands.evaluate import first_event_ranks, served_queries  # noqa: E402
from gr.commands.train import parse_overrides  # noqa: E402
from gr.data.config import RELEASE_YEAR  # noqa: E402
from gr.data.datamodule import SequenceDataModule  # noqa: E402
from gr.data.mappings import model_maps  # noqa: E402
from gr.data.readers import ML_GENRES, ml_100k_side_tables  # noqa: E402
from gr.export.format import ID_MAPS_DIR  # noqa: E402
from gr.export.item_encoder import ITEM_ENCODER, MEAN_QUERY, SERVED_QUERIES  # noqa: E402
from gr.export.item_store import ITEM_FEATURE  # noqa: E402
from gr.export.new_item_rows import NEIGHBOURS, place  # noqa: E402
from gr.export.new_items import add_items  # noqa: E402
from gr.export.writer import export_run, run_data, run_item_features  # noqa: E402
from gr.postfix_dnn.item_tower import POPULARITY_FEATURE  # noqa: E402
from gr.serving import Ranker  # noqa: E402
from gr.train import load_trained_model  # noqa: E402
from gr.train.config import TrainConfig, apply_override  # noqa: E402
from gr.train.metrics import score_ranks, target_metrics  # noqa: E402
from gr.train.run import run_popularity, train  # noqa: E402

RECIPE = "examples/custom_project/config.yaml"
SIDE_FILES = ("u.item", "u.user", "u.genre", "u.occupation")
METRICS = ("hr@10", "ndcg@10")
K = 10
PSEUDO_FOLDS = 5  # folds of the trained items placed as new in turn (pseudo_cold)
YEAR_DIM = 8  # the release year table's dim (as the age and occupation tables')


def held_out(events: np.ndarray, fraction: float, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """(items, users) held out: ``fraction`` of each of the distinct ids of ``events`` [N, 4]
    (user, item, rating, timestamp), drawn without replacement by ``seed``, sorted."""
    rng = np.random.default_rng(seed)
    picked = []
    for column in (1, 0):
        ids = np.unique(events[:, column])
        picked.append(np.sort(rng.choice(ids, size=round(fraction * len(ids)), replace=False)))
    return picked[0], picked[1]


def write_data(source: Path, out: Path, events: np.ndarray) -> Path:
    """``out``: ML-100K's side files (links to ``source``'s) with ``events`` as its u.data."""
    out.mkdir(parents=True)
    np.savetxt(out / "u.data", events, fmt="%d", delimiter="\t")
    for name in SIDE_FILES:
        if (source / name).is_file():
            (out / name).symlink_to((source / name).resolve())
    return out


def items_file(
    source: Path, items: np.ndarray, path: Path, year: bool, counts: Optional[Dict[int, int]] = None
) -> Path:
    """The ``gr items add`` file of ``items``: item_id, their genres joined by "|", with ``year``
    their release year buckets (as the reader gives them), with ``counts`` ({raw item: events})
    their ``item_popularity``."""
    side, _ = ml_100k_side_tables(source, True, False, "list", release_year=year)
    assert side is not None  # u.item is there
    row = {int(item): i for i, item in enumerate(side.keys)}
    genres = side.lists[ML_GENRES]
    years = [RELEASE_YEAR] if year else []
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["item_id", ML_GENRES, *years, *([POPULARITY_FEATURE] if counts is not None else [])])
        for item in items.tolist():
            index = np.array([row[item]])
            writer.writerow(
                [
                    item,
                    "|".join(genres.take(index).values.tolist()),
                    *(side.categorical[y][row[item]] for y in years),
                    *([counts.get(item, 0)] if counts is not None else []),
                ]
            )
    return path


def training_counts(data_path: Path, overrides: List[Tuple[str, str]], year: bool) -> Dict[int, int]:
    """{raw item: its events in the training parts of ``data_path``} (the events before each user's
    last two): what the popularity baseline counts, and the added items' ``item_popularity``."""
    data = SequenceDataModule(recipe(data_path, overrides, None, year).data)
    data.setup()
    assert data.item_map is not None  # set by setup()
    return dict(zip(data.item_map.raw.tolist(), data.popularity().tolist()))


def reusable(root: Path, arguments: Dict[str, Any], overrides: List[Tuple[str, str]]) -> None:
    """Record ``arguments`` and ``overrides`` in ``root/arguments.json``, or check that the runs ``root``
    holds were made with them (ValueError naming what differs): its data files are rewritten each call."""
    record = root / "arguments.json"
    current = json.loads(json.dumps({"arguments": arguments, "overrides": overrides}, default=str))
    if record.is_file():
        kept = json.loads(record.read_text())
        if kept != current:
            differ = sorted(
                k
                for k in {*kept["arguments"], *current["arguments"]}
                if kept["arguments"].get(k) != current["arguments"].get(k)
            )
            raise ValueError(
                f"{record}: its runs were made with other arguments ({differ or 'overrides'}); use another --work"
            )
    for name in ("train-data", "test-data", "new-user-data"):
        shutil.rmtree(root / name, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(current, indent=1))


def recipe(
    data_path: Path,
    overrides: List[Tuple[str, str]],
    id_dropout: Optional[float],
    year: bool,
    mlp_dims: Sequence[int] = (),
    feature_loss_weight: float = 0.0,
    popularity: bool = False,
) -> TrainConfig:
    """The custom project's config on ``data_path`` with ``overrides``, with the item tower (its
    ``id_dropout``, ``mlp_dims``, ``feature_loss_weight`` and ``popularity``) or without it (None);
    with ``year`` the items' release years (``data.release_year``) join the genres in the GenreEncoder
    (a table of their own) and the tower."""
    values = yaml.safe_load(Path(RECIPE).read_text())
    features = [ML_GENRES]
    if year:
        values["data"]["release_year"] = True
        values["model"]["tables"].append({"name": "year", "embedding_dim": YEAR_DIM, "features": [RELEASE_YEAR]})
        values["model"]["prefix_dnn"]["kwargs"]["year_feature"] = RELEASE_YEAR
        features.append(RELEASE_YEAR)
    if id_dropout is not None:
        values["model"]["item_tower"] = {
            "features": features,
            "id_dropout": id_dropout,
            "mlp_dims": list(mlp_dims),
            "feature_loss_weight": feature_loss_weight,
            "popularity": popularity,
        }
    for key, value in [("data.path", str(data_path)), ("sparse.backend", "torch"), *overrides]:
        apply_override(values, key, yaml.safe_load(value))
    return TrainConfig.from_dict(values)


def scored_events(export: Path, config: TrainConfig, data_path: Path) -> Dict[str, Any]:
    """The served queries of every test event of ``data_path`` against ``export``'s grown catalogue ->
    {"scores": [E, M] (the user's earlier items -inf, its target still ranked), "targets": [E],
    "queries": [E, d], "mean_row": [d] the mean of the trained rows, normalised, "popularity": [M]}."""
    ranker = Ranker.load(export)
    schema = ranker.model.schema
    reads = {*schema.token_features, *schema.common_ids, *schema.common_dense}
    data_config = replace(config.data, path=str(data_path))
    data = SequenceDataModule(
        data_config, ranker.model.config.eviction_block, model_maps(str(export / ID_MAPS_DIR)), new_ids="unknown"
    )
    data.setup()
    catalogue = ranker.catalogue()[0]
    vectors = catalogue.vectors[: data.num_items]
    scores, targets, queries = [], [], []
    for i, batch in enumerate(data.test_dataloader()):
        with torch.no_grad():
            query = served_queries(ranker, batch, reads, prefix=f"b{i}:")
        block = query @ vectors.T
        labels, rows = batch.labels, torch.arange(len(query))  # one query per test event
        target_scores = block[rows, labels["target_item"]].clone()
        owner = torch.repeat_interleave(rows, labels["exclude_offsets"].diff())
        block[owner, labels["exclude_items"]] = float("-inf")
        block[rows, labels["target_item"]] = target_scores
        scores.append(block)
        targets.append(labels["target_item"])
        queries.append(query)
    trained = export_trained_rows(ranker)
    mean_row = torch.nn.functional.normalize(torch.from_numpy(trained).mean(0), dim=0)
    return {
        "scores": torch.cat(scores),
        "targets": torch.cat(targets),
        "queries": torch.cat(queries),
        "mean_row": mean_row,
        "popularity": data.popularity(),
    }


def export_trained_rows(ranker: Ranker) -> np.ndarray:
    """The export's item table rows [M, d] (the catalogue's rows before normalising)."""
    sparse = ranker.model.sparse
    return sparse.tables[sparse.features[ITEM_FEATURE].table]


def pseudo_cold(run: Path, export: Path, scored: Dict[str, Any], warm: torch.Tensor, seed: int) -> Dict[str, Any]:
    """(a) over more events: each of ``PSEUDO_FOLDS`` folds of the trained items of the tower ``run``
    (its ``export``) placed as ``gr items add`` places new items (``gr.export.new_item_rows.place``:
    from their feature-only vectors and their counts in the test data, the other folds' vectors,
    feature-only vectors and training counts, the export's mean and served queries); the ``warm``
    [E] bool events of ``scored`` whose target is in a fold, ranked among that fold's items by the
    placed rows, by rows placed from the feature-only vectors' own directions (no neighbours) and by
    popularity -> {"events", "tower", "tower_features_direction", "popularity", "paired_hr@10" (tower
    - popularity), "paired_hr@10_neighbours" (tower - tower_features_direction)}. The queries were
    trained with these items' rows: an estimate of (a) from more events, not the same test."""
    model, _ = load_trained_model(run)
    data = run_data(run, "the pseudo-cold items")
    model.item_tower.set_items(run_item_features(run, model.prefix_dnn.feature_names, data), run_popularity(run))
    trained = export_trained_rows(Ranker.load(export)).astype(np.float64)
    with torch.no_grad():
        features = model.item_tower.feature_vectors(torch.arange(len(trained))).double().numpy()
    encoder = load_file(str(export / ITEM_ENCODER))
    counts, test_counts = run_popularity(run), scored["popularity"].numpy()
    assert counts is not None  # a run with an item tower stores its counts
    fold = np.random.default_rng(seed).integers(0, PSEUDO_FOLDS, len(trained))
    scores, targets = scored["scores"], scored["targets"]
    hits: Dict[str, List[torch.Tensor]] = {"tower": [], "tower_features_direction": [], "popularity": []}
    for k in range(PSEUDO_FOLDS):
        items, rest = np.flatnonzero(fold == k), fold != k
        chosen = warm & torch.from_numpy(np.isin(targets.numpy(), items))
        excluded = torch.isinf(scores[chosen])  # the user's earlier items
        for name, neighbours in (("tower", NEIGHBOURS), ("tower_features_direction", 0)):
            rows, _ = place(
                features[items],
                test_counts[items],
                trained[rest],
                features[rest],
                counts[rest],
                encoder[MEAN_QUERY],
                encoder[SERVED_QUERIES],
                neighbours,
            )
            candidates = torch.full_like(scores[chosen], float("-inf"))
            candidates[:, torch.from_numpy(items)] = scored["queries"][chosen] @ torch.from_numpy(rows).T
            candidates[excluded] = float("-inf")
            hits[name].append(ranked(candidates, targets[chosen])["hr@10"])
        counted = torch.where(torch.isinf(candidates), candidates, scored["popularity"].double().expand_as(candidates))
        hits["popularity"].append(ranked(counted, targets[chosen])["hr@10"])
    joined = {name: torch.cat(v) for name, v in hits.items()}
    return {
        "events": len(joined["tower"]),
        **{name: summary_of({"hr@10": v}) for name, v in joined.items()},
        "paired_hr@10": paired_difference(joined["tower"], joined["popularity"], "events"),
        "paired_hr@10_neighbours": paired_difference(joined["tower"], joined["tower_features_direction"], "events"),
    }


def mean_row_scores(scored: Dict[str, Any], trained: int) -> torch.Tensor:
    """``scored``'s scores with every added item (rows from ``trained`` on) scored as the mean trained row."""
    scores = scored["scores"].clone()
    added = scores[:, trained:]
    mean = (scored["queries"] @ scored["mean_row"]).unsqueeze(1).expand_as(added)
    scores[:, trained:] = torch.where(torch.isinf(added), added, mean)
    return scores


def ranked(scores: torch.Tensor, targets: torch.Tensor) -> Dict[str, torch.Tensor]:
    """{"hr@10": [E], "ndcg@10": [E]} of each target's rank under ``scores`` [E, M] (-inf: not ranked)."""
    none = torch.zeros(0, dtype=torch.int64)
    values = target_metrics(score_ranks(scores, targets, torch.zeros(len(targets) + 1, dtype=torch.int64), none), [K])
    return {m: values[m].double() for m in METRICS}


def summary_of(values: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """{metric: mean, se_<metric>: sample standard error of the mean} over the events."""
    out: Dict[str, float] = {}
    for m, v in values.items():
        out[m] = float(v.mean()) if len(v) else float("nan")
        out[f"se_{m}"] = float(v.std() / math.sqrt(len(v))) if len(v) > 1 else float("nan")
    return out


def score_spread(scores: torch.Tensor) -> float:
    """The mean over rows of ``scores`` [E, M] of the standard deviation of each row's finite scores."""
    finite = torch.isfinite(scores)
    counts = finite.sum(1).double()
    values = torch.where(finite, scores, 0.0).double()
    means = values.sum(1) / counts
    squares = torch.where(finite, (values - means.unsqueeze(1)) ** 2, 0.0).sum(1)
    return float((squares / (counts - 1)).sqrt().mean())


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=15, help="each run's epochs (its best validation epoch is kept)")
    parser.add_argument("--seed", type=int, default=0, help="draws the held-out items and users; seeds training")
    parser.add_argument("--held-out", type=float, default=0.1, help="fraction of the items, and of the users, held out")
    parser.add_argument("--id-dropout", type=float, default=0.2, help="the tower's model.item_tower.id_dropout")
    parser.add_argument(
        "--year", action=argparse.BooleanOptionalAction, default=True, help="the items' release years (both runs)"
    )
    parser.add_argument("--mlp-dims", default="", help="the tower's model.item_tower.mlp_dims, comma-separated")
    parser.add_argument(
        "--feature-loss-weight", type=float, default=0.0, help="the tower's model.item_tower.feature_loss_weight"
    )
    parser.add_argument(
        "--popularity",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the tower's model.item_tower.popularity (the encoder reads each item's log count)",
    )
    parser.add_argument(
        "--work", type=Path, default=None, help="work in (and keep) this directory; reuse the runs it holds"
    )
    args, rest = smoke.parse_args(parser, {"epochs": 1}, argv, known=True)
    mlp_dims = [int(d) for d in args.mlp_dims.split(",") if d]
    overrides = [
        ("trainer.max_epochs", str(args.epochs)),
        ("trainer.early_stopping_patience", "0"),
        ("trainer.enable_progress_bar", "false"),
        ("trainer.seed", str(args.seed)),
        ("data.seed", str(args.seed)),
    ]
    if args.smoke:
        overrides += smoke.ML_100K_SMOKE_TRAINING
    overrides += parse_overrides(parser, rest)
    source = Path(next((v for k, v in overrides if k == "data.path"), str(smoke.ML_100K)))
    overrides = [(k, v) for k, v in overrides if k != "data.path"]
    events = np.loadtxt(source / "u.data", dtype=np.int64, ndmin=2)
    cold_items, cold_users = held_out(events, args.held_out, args.seed)
    start_load = load_average()
    with contextlib.ExitStack() as stack:
        root = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        reusable(root, {k: v for k, v in vars(args).items() if k != "work"}, overrides)
        trained_on = ~np.isin(events[:, 1], cold_items) & ~np.isin(events[:, 0], cold_users)
        train_data = write_data(source, root / "train-data", events[trained_on])
        test_data = write_data(source, root / "test-data", events[~np.isin(events[:, 0], cold_users)])
        user_data = write_data(source, root / "new-user-data", events[np.isin(events[:, 0], cold_users)])
        counts = training_counts(test_data, overrides, args.year)
        new_items = items_file(source, cold_items, root / "held_out_items.csv", args.year, counts)
        plain_items = items_file(source, cold_items, root / "held_out_items_no_counts.csv", args.year)
        scored, seconds, added = {}, {}, {}
        for name, id_dropout in (("tower", args.id_dropout), ("no_tower", None)):
            tower_options = (mlp_dims, args.feature_loss_weight, args.popularity)
            config = recipe(train_data, overrides, id_dropout, args.year, *tower_options)
            start = time.perf_counter()
            if (root / name / "metrics.json").is_file():  # trained by an earlier call with --work
                metrics = json.loads((root / name / "metrics.json").read_text())
            else:
                shutil.rmtree(root / name, ignore_errors=True)  # an unfinished run of an earlier call
                metrics = train(config, root / name)
            if not (root / f"{name}-export").is_dir():  # kept by an earlier call, unless removed
                export_run(root / name, root / f"{name}-export")
            seconds[name] = time.perf_counter() - start
            added[name] = add_items(
                root / f"{name}-export",
                new_items if id_dropout is not None else plain_items,
                root / f"{name}-grown",
                overwrite=True,
            )
            scored[name] = scored_events(root / f"{name}-grown", config, test_data)
            print(f"{name}: validation-picked test hr@10 {metrics['hr@10']:.4f} ({seconds[name]:.1f} s)", flush=True)
        users_config = recipe(user_data, overrides, args.id_dropout, args.year, *tower_options).data
        metrics_b = first_event_metrics(first_event_ranks(root / "tower-export", users_config))
        rows = export_trained_rows(Ranker.load(root / "tower-grown"))
        trained_count = added["tower"]["trained_items"]
        warm_events = scored["tower"]["targets"] < trained_count
        a_pseudo = pseudo_cold(root / "tower", root / "tower-export", scored["tower"], warm_events, args.seed)
    trained = added["tower"]["trained_items"]
    if added["no_tower"]["trained_items"] != trained or not torch.equal(
        scored["tower"]["targets"], scored["no_tower"]["targets"]
    ):
        raise RuntimeError("cold_start: the two runs were not scored on the same items and events")
    targets = scored["tower"]["targets"]
    cold = targets >= trained
    tower, plain = scored["tower"]["scores"], scored["no_tower"]["scores"]
    restricted = torch.full_like(tower[:1], float("-inf"))
    restricted[:, trained:] = 0.0  # only the held-out items are candidates

    def among_cold(scores: torch.Tensor) -> Dict[str, torch.Tensor]:
        return ranked((scores + restricted)[cold], targets[cold])

    popularity = scored["tower"]["popularity"].double().expand(len(targets), -1).clone()
    popularity[torch.isinf(tower)] = float("-inf")  # the same exclusions
    metrics_a = {  # without the tower every held-out item ties (zero rows or the mean row alike)
        "tower": among_cold(tower),
        "popularity": among_cold(popularity),
        "no_tower": among_cold(plain),
    }
    mean_row = mean_row_scores(scored["no_tower"], trained)
    whole_a = {
        "tower": ranked(tower[cold], targets[cold]),
        "no_tower_zero_rows": ranked(plain[cold], targets[cold]),
        "no_tower_mean_row": ranked(mean_row[cold], targets[cold]),
    }
    metrics_c = {"tower": ranked(tower[~cold], targets[~cold]), "no_tower": ranked(plain[~cold], targets[~cold])}
    top = tower.topk(K, dim=1).indices
    top_share = float((top >= trained).double().mean())
    target_share = float(cold.double().mean())
    a_vs_pop = paired_difference(metrics_a["tower"]["hr@10"], metrics_a["popularity"]["hr@10"], "events")
    c_vs_plain = paired_difference(metrics_c["tower"]["hr@10"], metrics_c["no_tower"]["hr@10"], "events")
    ratio = top_share / target_share if target_share else float("nan")
    warm_scores = tower[~cold]
    finite = torch.isfinite(warm_scores)
    norms = np.linalg.norm(rows, axis=1)
    held, kept = warm_scores[:, trained:], warm_scores[:, :trained]
    placement = {  # the held-out items' score scale against the trained items' (warm users' queries)
        "mean_cosine_held_out": float(held[finite[:, trained:]].mean()),
        "mean_cosine_trained": float(kept[finite[:, :trained]].mean()),
        "spread_held_out": score_spread(held),
        "spread_trained": score_spread(kept),
        "mean_best_cosine_held_out": float(held.max(dim=1).values.mean()),
        "mean_tenth_cosine_trained": float(kept.topk(K, dim=1).values[:, -1].mean()),
        "mean_row_norm_held_out": float(norms[trained:].mean()),
        "mean_row_norm_trained": float(norms[:trained].mean()),
    }
    model, flags = cpu()
    summary = {
        "bench": "cold_start",
        "seed": args.seed,
        "epochs": args.epochs,
        "id_dropout": args.id_dropout,
        "year": args.year,
        "mlp_dims": mlp_dims,
        "feature_loss_weight": args.feature_loss_weight,
        "popularity": args.popularity,
        "held_out": {"fraction": args.held_out, "items": len(cold_items), "users": len(cold_users)},
        "events": {"a_held_out_targets": int(cold.sum()), "c_other_targets": int((~cold).sum())},
        "a_among_held_out": {name: summary_of(v) for name, v in metrics_a.items()},
        "a_whole_catalogue": {name: summary_of(v) for name, v in whole_a.items()},
        "a_pseudo_cold": a_pseudo,
        "b_new_users": metrics_b,
        "c_other_events": {name: summary_of(v) for name, v in metrics_c.items()},
        "paired_hr@10": {
            "a_tower_minus_popularity": a_vs_pop,
            "b_new_user_minus_popularity": metrics_b["paired"]["hr@10"],
            "c_tower_minus_no_tower": c_vs_plain,
        },
        "placement": placement,
        "gain_fit": added["tower"].get("gain_fit"),
        "top10_share_held_out": top_share,
        "target_share_held_out": target_share,
        "share_ratio": ratio,
        "targets": {
            "a_tower_above_popularity_by_more_than_one_se": a_vs_pop["in_se"] > 1.0,
            "b_new_user_above_popularity_by_more_than_one_se": metrics_b["paired"]["hr@10"]["in_se"] > 1.0,
            "c_tower_within_one_se_of_no_tower_or_better": c_vs_plain["in_se"] >= -1.0,
            "top10_share_within_2x_of_target_share": 0.5 <= ratio <= 2.0,
        },
        "train_seconds": seconds,
        "cpu": model,
        "cpu_flags": flags,
        "load_average": {"start": start_load, "end": load_average()},
    }
    for group, metrics in (("(a) among held-out", metrics_a), ("(c) other events", metrics_c)):
        print(group + ": " + ", ".join(f"{n} hr@10 {float(v['hr@10'].mean()):.4f}" for n, v in metrics.items()))
    pseudo = a_pseudo["paired_hr@10"]
    print(
        f"(a) pseudo-cold trained items ({a_pseudo['events']} events): tower hr@10 {a_pseudo['tower']['hr@10']:.4f}, "
        f"popularity {a_pseudo['popularity']['hr@10']:.4f}, paired {pseudo['mean']:+.4f} ({pseudo['in_se']:+.2f} SE); "
        f"placed from the features' own direction {a_pseudo['tower_features_direction']['hr@10']:.4f}"
    )
    print("(b) held-out users' first events from their features:")
    print_first_event_metrics(metrics_b)
    print(f"top-10 share of held-out items {top_share:.4f} vs their share of targets {target_share:.4f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
