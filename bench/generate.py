"""Generation speed: plain greedy vs speculative greedy (retrieval pools, draft model), relaxed verification.

For each dataset (MovieLens-100K and the synthetic set) a target model and a draft model are trained
with the public entry (``train.py``) unless their exports already exist, exported with
``gr.export``, and served by ``gr.serving.Ranker``. Target recipes: ML-100K ``configs/ml100k_hstu.yaml``
(early stopping on val HR@10), synthetic ``configs/quickstart.yaml`` (sequences up to 100).
Draft models: 1 HSTU layer and smaller dims (ML-100K 24, synthetic 16), cached incrementally.
Each evaluated user's history is their sequence without the last two events (never trained on);
every mode generates a slate of K items with ``Ranker.generate`` (user cache warm, so a request
re-runs only the last history token), and reports:

* items/s and the speedup over plain greedy, for K = 10 and 50; ms per HSTU pass (a verification
  pass of a draft tree against greedy's one-token pass);
* acceptance rate (accepted / drafted tokens), mean accepted items per HSTU pass, time share of
  draft lookup;
* pools (DARE): n-gram pools of the users' training sequences and of the greedy slates generated
  for ``--pool-users`` other users (not the evaluated ones; ``pool-served``: those slates alone,
  the model's own transitions as served traffic holds them), built per user group (k-means
  of the model's user embeddings = the query at a user's last history token) from many small
  groups to one pool of all users; users with fewer than ``--min-history`` items are routed by
  attribute (ML-100K: age bucket and occupation). Trees sized by the adaptive budget shared across
  requests (``gr.generation.budget.SharedBudget``, one per mode, as a server keeps one per draft
  source: warmed on ``--warmup-users`` other users' requests (the evaluated users' own when no
  other users are left), then kept through every K);
  ``pool-all-fixed`` drafts full trees every pass; ``*-per-request``: the adaptive budget learning
  within each request only (as before it was shared);
* the draft model (assisted generation; adaptive depth, ``--draft-width`` candidates per level),
  with the cost of one draft pass relative to one target pass (the draft model's own greedy);
* ranking self-drafts (``RankingDraftSource``): the runners-up of the query that picked the last item,
  as a tree (16 / 3 / 2 / 1 per level, 32 nodes): no pool, no draft model;
* relaxed verification on the all-users pool: HR@K of the slate against the user's two held-out
  events, next to strict's (= greedy's).
Strict modes are checked to return exactly the greedy items (``mismatches`` must be 0).

Run: ``.venv/bin/python bench/generate.py --runs-dir runs/bench_generate`` (trains 4 small models
on first use, then reuses their exports there: delete them after changing the training code).
``--smoke`` trains and exports its tiny model in a temporary directory every time. Last line: one
JSON object with the speedups.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402
from _host import run_python  # noqa: E402

from gr.data.config import DataConfig
from gr.data.datamodule import SequenceDataModule
from gr.data.readers import read_ml_100k
from gr.generation.budget import AdaptiveBudget, SharedBudget
from gr.generation.decoding import Relaxed, Strict
from gr.generation.drafts import DraftSource, ModelDraftSource, PoolDraftSource, RankingDraftSource
from gr.generation.pools import GroupedPools, SequencePool
from gr.serving import Ranker
from gr.serving.generate import ServingGenerativeModel

ROOT = Path(__file__).resolve().parents[1]
HELD_OUT = 2
PER_REQUEST = ("pool-all", "draft-model")  # also measured with a budget that learns per request only
SMOKE = {
    "datasets": ["smoke"],
    "users": 4,
    "pool_users": 4,
    "warmup_users": 2,
    "ks": [5],
    "groups": [1],
    "runs_dir": None,  # a temporary directory: nothing reused from an earlier run
}  # the tiny smoke model
DATASETS = {
    # (config, target arguments, draft arguments)
    # (a) the ML-100K recipe, a short run (15 epochs, best val HR@10 kept)
    "ml100k": (
        "configs/ml100k_hstu.yaml",
        ["--trainer.monitor", "val/hr@10", "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "15"],
        [
            "--model.hstu.num_layers",
            "1",
            "--model.hstu.hidden_dim",
            "24",
            "--model.hstu.attention_dim",
            "24",
            "--model.hstu.linear_dim",
            "24",
            "--trainer.max_epochs",
            "6",
        ],
    ),
    # (b) hidden 256, 4 layers, histories up to 1024, on synthetic data with ranked successors
    "long": (
        "configs/generation_long.yaml",
        ["--trainer.enable_progress_bar", "false"],
        [
            "--model.hstu.num_layers",
            "1",
            "--model.hstu.num_heads",
            "1",
            "--model.hstu.hidden_dim",
            "32",
            "--model.hstu.attention_dim",
            "32",
            "--model.hstu.linear_dim",
            "32",
        ],
    ),
    # --smoke: a tiny synthetic model trained in seconds (checks the bench runs, measures nothing); it is its
    # own draft model (None: no second training and export)
    "smoke": (
        "configs/quickstart.yaml",
        [
            "--data.max_seq_len",
            "60",
            "--model.hstu.max_seq_len",
            "60",
            "--data.synthetic.num_users",
            "120",
            "--trainer.max_epochs",
            "1",
            "--trainer.enable_progress_bar",
            "false",
        ],
        None,
    ),
}


def ensure_export(
    runs: Path, name: str, config: str, extra: Sequence[str], data_path: str, forked: bool = False
) -> Path:
    """Train (train.py) and export (gr.export) a model unless already there -> the export dir. Each
    command runs in a fresh interpreter, or with ``forked`` (the smoke model) in a child of this one."""
    run, export = runs / name, runs / f"{name}_export"
    args = ["--data.path", data_path] if "ml100k" in config else []
    if (export / "default").exists():
        print(f"reusing {export} (delete it to train and export again)", file=sys.stderr, flush=True)
        return export
    commands = [["-m", "gr.export", str(run), str(export)]]
    if not (run / "metrics.json").exists():
        train = [str(ROOT / "train.py"), "--config", str(ROOT / config), "--out", str(run), *args, *extra]
        commands.insert(0, train)
    for command in commands:
        done = run_python(command, forked, cwd=ROOT, capture=False)
        if done.returncode != 0:
            raise RuntimeError(f"python {' '.join(command)} failed with exit status {done.returncode}")
    return export


def user_data(run: Path, data_path: str) -> Tuple[List[np.ndarray], List[np.ndarray], List[object]]:
    """Per user (dense id order): items, timestamps (model ids, time order) and an attribute key."""
    config = yaml.safe_load((run / "config.yaml").read_text())["data"]
    if config["source"] == "ml-100k":
        config["path"] = data_path
    module = SequenceDataModule(DataConfig.from_dict(config))
    module.setup()
    seqs = module.corpus.sequences
    items = [seqs.items[a:b] for a, b in zip(seqs.offsets[:-1], seqs.offsets[1:])]
    times = [seqs.timestamps[a:b] for a, b in zip(seqs.offsets[:-1], seqs.offsets[1:])]
    attributes: List[object] = [None] * len(items)
    if config["source"] == "ml-100k":
        side = read_ml_100k(data_path, item_features=False, user_features=True).user_side
        dense = module.user_map.encode(side.keys, unknown=-1)
        for u, age, job in zip(dense, side.categorical["user_age"], side.categorical["user_occupation"]):
            if u >= 0:
                attributes[u] = (int(age), str(job))
    return items, times, attributes


def run_modes(
    modes: Dict[str, Tuple[Ranker, dict]], users: Sequence[int], histories: Dict[int, dict], k: int
) -> Dict[str, Dict[str, object]]:
    """Generate a slate for every user in every mode -> per mode: items per user and aggregate statistics.

    The modes take turns user by user (in a rotating order), so load from other processes on the
    machine falls on all of them alike; each request is timed on its own.
    """
    labels = list(modes)
    totals = {
        label: {"slates": {}, "seconds": 0.0, "passes": 0, "drafted": 0, "accepted": 0, "draft_s": 0.0}
        for label in labels
    }
    for i, u in enumerate(users):
        for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
            ranker, options = modes[label]
            began = time.perf_counter()
            result = ranker.generate(u, histories[u]["history"], k, attribute=histories[u]["attribute"], **options)
            t = totals[label]
            t["seconds"] += time.perf_counter() - began
            t["slates"][u] = result.items
            t["passes"] += result.stats.passes
            t["drafted"] += result.stats.drafted
            t["accepted"] += result.stats.accepted
            t["draft_s"] += result.stats.draft_seconds
    return {
        label: {
            "slates": t["slates"],
            "seconds": t["seconds"],
            "items_per_s": k * len(users) / t["seconds"],
            "pass_ms": 1e3 * (t["seconds"] - t["draft_s"]) / max(t["passes"], 1),
            "acceptance": t["accepted"] / t["drafted"] if t["drafted"] else 0.0,
            "accepted_per_pass": t["accepted"] / max(t["passes"], 1),
            "draft_share": t["draft_s"] / t["seconds"],
            "passes": t["passes"],
        }
        for label, t in totals.items()
    }


def user_embeddings(ranker: Ranker, histories: Sequence[dict], chunk: int = 16) -> torch.Tensor:
    """The query at each user's last history token, from batched HSTU passes of ``chunk`` users: [U, d]."""
    if len(histories) > chunk:
        return torch.cat(
            [user_embeddings(ranker, histories[i : i + chunk], chunk) for i in range(0, len(histories), chunk)]
        )
    catalogue, _ = ranker.catalogue()
    lengths = torch.tensor([len(h["item_id"]) for h in histories])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    x = catalogue.tokens[torch.from_numpy(np.concatenate([h["item_id"] for h in histories]))]
    timestamps = torch.from_numpy(np.concatenate([h["timestamps"] for h in histories]))
    # each token's query time is the next event's; the last one's is the request time (its own, as generate's default)
    query_times = torch.from_numpy(
        np.concatenate([np.append(h["timestamps"][1:], h["timestamps"][-1]) for h in histories])
    )
    next_event = ranker.model.config.query_time == "next_event"
    with torch.inference_mode():
        hidden = ranker.model.engine.hstu(
            x, offsets, int(lengths.max()), timestamps, None, query_times if next_event else None
        )
    return ServingGenerativeModel(catalogue, {}).queries(hidden[offsets[1:] - 1])


def hit_rate(slates: Dict[int, List[int]], held_out: Dict[int, set]) -> float:
    return float(np.mean([bool(set(s) & held_out[u]) for u, s in slates.items()]))


def ndcg(slates: Dict[int, List[int]], held_out: Dict[int, set]) -> float:
    """Mean NDCG of each slate against the user's held-out events (binary gains)."""
    out = []
    for u, slate in slates.items():
        dcg = sum(1.0 / np.log2(i + 2) for i, item in enumerate(slate) if item in held_out[u])
        ideal = sum(1.0 / np.log2(i + 2) for i in range(min(len(held_out[u]), len(slate))))
        out.append(dcg / ideal if ideal else 0.0)
    return float(np.mean(out))


def profile_pass(
    ranker: Ranker,
    users: Sequence[int],
    histories: Dict[int, dict],
    sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    repeats: int = 5,
) -> Dict[str, Dict[int, float]]:
    """Where a verification pass goes: ms of the HSTU block (``run_block`` of n chain tokens after the
    user's cached history), of the query head over its n outputs, and of one catalogue search, per n
    (median over users x repeats). A flat HSTU curve means fixed overhead dominates."""
    from gr.generation.decoding import chain_mask, start  # the pieces a pass is made of

    catalogue, _ = ranker.catalogue()
    model = ServingGenerativeModel(catalogue, {})
    times: Dict[str, Dict[int, List[float]]] = {"hstu_ms": {}, "heads_ms": {}, "search_ms": {}}
    with torch.inference_mode():
        for u in users:
            hist = histories[u]["history"]
            items, ts = torch.from_numpy(hist["item_id"]), torch.from_numpy(hist["timestamps"])
            state = start(model, items, ts, int(ts[-1]))
            room = ranker.model.config.max_seq_len - state.cache.length
            for n in [n for n in sizes if n <= room]:
                x = catalogue.tokens[torch.arange(n)]
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    hidden, _, _ = model.engine.run_block(
                        state.cache, x, torch.full((n,), int(ts[-1])), torch.arange(1, n + 1), chain_mask(n)
                    )
                    t1 = time.perf_counter()
                    q = model.queries(hidden)
                    t2 = time.perf_counter()
                    catalogue.index.search(q[:1], torch.zeros(1, catalogue.index.num_items, dtype=torch.bool), 1)
                    t3 = time.perf_counter()
                    for key, value in (("hstu_ms", t1 - t0), ("heads_ms", t2 - t1), ("search_ms", t3 - t2)):
                        times[key].setdefault(n, []).append(1e3 * value)
    return {key: {n: round(float(np.median(v)), 3) for n, v in per.items()} for key, per in times.items()}


def bench_dataset(
    name: str,
    runs: Path,
    data_path: str,
    ks: Sequence[int],
    num_users: int,
    pool_users: int,
    warmup_users: int,
    groups: Sequence[int],
    relaxed: Relaxed,
    min_history: int,
    draft_depth: int,
    draft_width: int,
    pool_depth: int,
    pool_nodes: int,
    forked: bool = False,
) -> Dict:
    config, target_args, draft_args = DATASETS[name]
    target = ensure_export(runs, f"{name}_target", config, target_args, data_path, forked)
    draft = (
        target
        if draft_args is None
        else ensure_export(runs, f"{name}_draft", config, [*target_args, *draft_args], data_path, forked)
    )
    items, times, attributes = user_data(runs / f"{name}_target", data_path)
    ranker = Ranker.load(target, cache_bytes=2**31, threads=1)
    max_len = ranker.model.config.max_seq_len
    rng = np.random.default_rng(0)
    order = rng.permutation(len(items)).tolist()
    users = sorted(order[:num_users])
    generators = sorted(order[num_users : num_users + pool_users])
    # no users left (model (b) with all others in the pools): the evaluated users' own requests warm
    # the budgets (their slates are in no pool, so no source looks better than it is)
    warmers = sorted(order[num_users + pool_users : num_users + pool_users + warmup_users]) or users[:warmup_users]
    histories, held_out, train_seqs = {}, {}, []
    for u in range(len(items)):
        keep = len(items[u]) - HELD_OUT
        train_seqs.append(items[u][:keep].tolist())
        start = max(0, keep - (max_len - max(ks)))
        histories[u] = {
            "history": {"item_id": items[u][start:keep], "timestamps": times[u][start:keep]},
            "attribute": attributes[u],
        }
        held_out[u] = set(items[u][keep:].tolist())
    embeddings_t = user_embeddings(ranker, [histories[u]["history"] for u in range(len(items))])
    draft_ranker = Ranker.load(draft, cache_bytes=2**31, threads=1)
    for u in sorted(set(users + warmers)):  # warm user caches: every timed request re-runs only its last history token
        ranker.generate(u, histories[u]["history"], 1)
        draft_ranker.generate(u, histories[u]["history"], 1)
    lengths = [len(histories[u]["history"]["item_id"]) for u in range(len(items))]
    print(
        f"# {name}: {len(items)} users, {ranker.catalogue()[0].index.num_items} items, evaluating {len(users)} "
        f"users, history length mean {np.mean([lengths[u] for u in users]):.0f}",
        flush=True,
    )
    # pools hold what was seen (every user's training sequence) and what was generated: the greedy
    # slates of other users (never the evaluated users' own), continuing their histories
    # (served as they would be: speculatively, from a pool that grows with every slate served)
    # ``slates`` holds the served slates alone (each after its history's last items): the model's own
    # greedy transitions, what DARE's traffic pools hold
    began, served, slates = time.perf_counter(), SequencePool(), SequencePool()
    for u in generators:
        result = ranker.generate(
            u,
            histories[u]["history"],
            max(ks),
            attribute=histories[u]["attribute"],
            draft=PoolDraftSource(served, pool_depth, pool_nodes),
            budget=AdaptiveBudget(),
        )
        train_seqs[u] = train_seqs[u] + result.items
        served.add(train_seqs[u])
        slates.add(histories[u]["history"]["item_id"][-slates.max_ngram :].tolist() + result.items)
    print(
        f"# pools: {len(train_seqs)} training sequences + {len(generators)} generated slates of "
        f"{max(ks)} ({time.perf_counter() - began:.0f}s)",
        flush=True,
    )
    draft_catalogue = draft_ranker.catalogue()[0]
    adaptive = AdaptiveBudget(max_depth=pool_depth, nodes_per_level=max(1, pool_nodes // pool_depth))
    sources: Dict[str, Tuple[DraftSource, object, Optional[AdaptiveBudget]]] = {}
    for g in groups:
        pools = GroupedPools.build(train_seqs, embeddings_t, g, attributes, seed=0)
        label = "pool-all" if g == 1 else f"pool-{g}groups"
        sources[label] = (PoolDraftSource(pools, pool_depth, pool_nodes, min_history), Strict(), adaptive)
    sources["pool-all-fixed"] = (sources["pool-all"][0], Strict(), None)
    sources["pool-served"] = (PoolDraftSource(slates, pool_depth, pool_nodes), Strict(), adaptive)
    sources["draft-model"] = (
        ModelDraftSource(ServingGenerativeModel(draft_catalogue, {}), draft_catalogue.index, draft_depth, draft_width),
        Strict(),
        AdaptiveBudget(max_depth=draft_depth, nodes_per_level=draft_width),
    )
    sources["ranking"] = (RankingDraftSource(ranker.catalogue()[0].index), Strict(), None)
    sources["ranking-adaptive"] = (sources["ranking"][0], Strict(), AdaptiveBudget(max_depth=4, nodes_per_level=8))
    sources["pool-all-relaxed"] = (sources["pool-all"][0], relaxed, adaptive)
    for label in PER_REQUEST:  # as before budgets were shared: each request learns alone
        sources[f"{label}-per-request"] = sources[label]
    sources["ranking-relaxed"] = (sources["ranking"][0], relaxed, None)
    profile = profile_pass(ranker, users[:4], histories)
    print(f"# {name} pass profile (ms by block tokens n): {json.dumps(profile)}", flush=True)
    out: Dict[str, Dict] = {"pass_profile": profile}
    shared = {
        label: SharedBudget(budget)
        for label, (_, _, budget) in sources.items()
        if budget is not None and not label.endswith("-per-request")
    }
    speculative = {
        label: (ranker, {"draft": source, "verification": verification, "budget": shared.get(label, budget)})
        for label, (source, verification, budget) in sources.items()
    }
    if warmers:  # the shared budgets learn from earlier requests first, as a serving process has
        print(f"# warming the shared budgets on {len(warmers)} users' requests of {max(ks)}", flush=True)
        run_modes({label: speculative[label] for label in shared}, warmers, histories, max(ks))
    for k in ks:
        modes = {"greedy": (ranker, {}), "draft-model-alone": (draft_ranker, {}), **speculative}
        counts = {label: (b.drafted_passes, b.plain_passes) for label, b in shared.items()}
        results = run_modes(modes, users, histories, k)
        base, alone = results.pop("greedy"), results.pop("draft-model-alone")
        base_hr, base_ndcg = hit_rate(base["slates"], held_out), ndcg(base["slates"], held_out)
        cost = base["items_per_s"] / alone["items_per_s"]
        print(
            f"{name} K={k:<3} {'greedy':<18} {base['items_per_s']:8.1f} items/s  speedup 1.00  "
            f"{base['pass_ms']:5.2f} ms/pass  HR@{k} {base_hr:.3f}  NDCG@{k} {base_ndcg:.3f}  "
            "(draft model greedy alone: "
            f"{alone['items_per_s']:.1f} items/s, a draft step costs {cost:.2f} target steps)  "
            f"load average {load_average()}",
            flush=True,
        )
        out[f"K{k}"] = {
            "greedy_items_per_s": base["items_per_s"],
            "greedy_pass_ms": base["pass_ms"],
            "greedy_hr": base_hr,
            "greedy_ndcg": base_ndcg,
            "draft_step_cost": round(cost, 3),
            "load_average": load_average(),
        }
        for label, res in results.items():
            verification = sources[label][1]
            mismatches = sum(res["slates"][u] != base["slates"][u] for u in users)
            hr, nd = hit_rate(res["slates"], held_out), ndcg(res["slates"], held_out)
            speedup = res["items_per_s"] / base["items_per_s"]
            drafting = _drafted_share(shared[label], counts[label]) if label in shared else 1.0
            print(
                f"{name} K={k:<3} {label:<18} {res['items_per_s']:8.1f} items/s  speedup {speedup:4.2f}  "
                f"{res['pass_ms']:5.2f} ms/pass  accept {res['acceptance']:.3f}  "
                f"accepted/pass {res['accepted_per_pass']:.2f}  draft share {res['draft_share']:.3f}  "
                f"drafting {drafting:.2f}  HR@{k} {hr:.3f}  NDCG@{k} {nd:.3f}  "
                f"{'changed' if isinstance(verification, Relaxed) else 'mismatches'} {mismatches}",
                flush=True,
            )
            out[f"K{k}"][label] = {
                "speedup": round(speedup, 3),
                "pass_ms": round(res["pass_ms"], 3),
                "acceptance": round(res["acceptance"], 3),
                "accepted_per_pass": round(res["accepted_per_pass"], 3),
                "draft_share": round(res["draft_share"], 3),
                "drafting": round(drafting, 3),
                "hr": round(hr, 4),
                "ndcg": round(nd, 4),
                "differs_from_greedy": mismatches,
            }
    for label, b in shared.items():
        print(f"# {name} {label}: {describe(b)}", flush=True)
    out["shared_budgets"] = {label: describe(b) for label, b in shared.items()}
    return out


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def describe(budget: SharedBudget) -> str:
    """What a shared budget learned: items and ms of a drafted pass against a plain pass."""
    ms = {
        key: 1e3 * v if v is not None else float("nan")
        for key, v in (("drafted", budget.drafted_seconds), ("plain", budget.plain_seconds))
    }
    return (
        f"{budget.drafted_items or 0.0:.2f} items per drafted pass in {ms['drafted']:.2f} ms, plain pass "
        f"{ms['plain']:.2f} ms: {'pays' if budget.pays() else 'does not pay'} "
        f"({budget.drafted_passes} drafted, {budget.plain_passes} plain passes)"
    )


def _drafted_share(budget: SharedBudget, before: Tuple[int, int]) -> float:
    """Share of the passes since ``before`` (drafted, plain counts) that drafted."""
    drafted, plain = budget.drafted_passes - before[0], budget.plain_passes - before[1]
    return drafted / max(drafted + plain, 1)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "bench_generate")
    parser.add_argument(
        "--data-path", default=str(smoke.ML_100K), help="MovieLens-100K (default: $GR_ML100K_DIR or data/ml-100k)"
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 50], help="slate sizes K")
    parser.add_argument("--users", type=int, default=20, help="evaluated users per dataset")
    parser.add_argument("--pool-users", type=int, default=100, help="other users whose greedy slates join the pools")
    parser.add_argument(
        "--warmup-users", type=int, default=20, help="other users whose requests warm the shared budgets (0: cold)"
    )
    parser.add_argument("--groups", type=int, nargs="+", default=[64, 8, 1], help="pool groups (1 = all users)")
    parser.add_argument("--min-history", type=int, default=30, help="shorter histories route by attribute")
    parser.add_argument("--pool-depth", type=int, default=8)
    parser.add_argument("--pool-nodes", type=int, default=32)
    parser.add_argument("--draft-depth", type=int, default=4)
    parser.add_argument("--draft-width", type=int, default=3, help="draft-model candidates per level")
    parser.add_argument("--relaxed-top-k", type=int, default=5)
    parser.add_argument("--relaxed-min-prob", type=float, default=0.02)
    parser.add_argument("--temperature", type=float, default=0.05, help="the training softmax temperature")
    parser.add_argument("--datasets", nargs="+", default=["ml100k", "long"], choices=list(DATASETS))
    args, _ = smoke.parse_args(parser, SMOKE, argv)
    torch.set_num_threads(1)
    relaxed = Relaxed(args.relaxed_top_k, args.relaxed_min_prob, args.temperature)
    scratch = tempfile.TemporaryDirectory()
    runs_dir = args.runs_dir if args.runs_dir is not None else Path(scratch.name)
    results = {
        name: bench_dataset(
            name,
            runs_dir,
            args.data_path,
            args.ks,
            args.users,
            args.pool_users,
            args.warmup_users,
            args.groups,
            relaxed,
            args.min_history,
            args.draft_depth,
            args.draft_width,
            args.pool_depth,
            args.pool_nodes,
            args.smoke,
        )
        for name in args.datasets
    }
    scratch.cleanup()
    summary = {
        name: {
            k: {label: v["speedup"] for label, v in modes.items() if isinstance(v, dict) and "speedup" in v}
            for k, modes in res.items()
            if k.startswith("K")
        }
        for name, res in results.items()
    }
    print(json.dumps({"speedup_over_greedy": summary, "details": results}))


if __name__ == "__main__":
    main()
