"""bench/daily_retrain.py at its ``--smoke`` size (its own module, so the suite's workers share the
benchmarks' time): a cold run, day 0 and warm runs (the recipe and one variant of it) on ML-100K's time
split, one JSON line comparing each warm run with the cold run and day 0 user by user."""

import json
import math
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_daily_retrain_bench_compares_warm_cold_and_day0_runs_on_the_same_test_users(ml_100k, warm_python):
    """With replay: the warm runs replay day 0's events from its 70th time percentile on (the
    smoke's variant, replay=0, replays none)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GR_ML100K_DIR": str(ml_100k), "OMP_NUM_THREADS": "1"}
    run = warm_python.run(["bench/daily_retrain.py", "--smoke", "--replay-from", "70"], cwd=ROOT, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["replay_from"] == 70 and result["cuts"]["p70"] < result["cuts"]["p80"] < result["cuts"]["p90"]
    runs = result["runs"]
    variant = "warm[replay=0]"
    assert set(runs) == {"cold", "warm", variant, "day0"} and runs["day0"]["test_users"] == result["test_users"] > 0
    assert result["variants"] == {
        "warm": {"max_epochs": "1", "replay_from": "70"},
        variant: {**result["variants"]["warm"], "replay": "0"},
    }
    assert runs["day0"]["test_targets"] == result["test_targets"] > result["test_users"]  # every test event
    assert all(0 <= runs[r]["hr@10"] <= 1 for r in runs)
    assert (
        result["warm_time_over_cold"]
        == runs["warm"]["time_over_cold"]
        == runs["warm"]["seconds"] / runs["cold"]["seconds"]
    )
    assert result["warm_cpu_time_over_cold"] == runs["warm"]["cpu_seconds"] / runs["cold"]["cpu_seconds"]
    assert all(0 < runs[r]["cpu_seconds"] for r in ("cold", "warm", variant))
    pairs = result["paired"]
    warm_pairs = {f"{w}_minus_{other}" for w in ("warm", variant) for other in ("cold", "day0")}
    assert set(pairs) == {*warm_pairs, "cold_minus_day0", f"{variant}_minus_warm"}
    for pair in pairs.values():
        assert pair["users_higher"] + pair["users_lower"] <= result["test_users"] and pair["se"] >= 0
    one_seed = result["runs"]  # one seed: each paired mean is the difference of the runs' means
    for warm in ("warm", variant):
        assert pairs[f"{warm}_minus_day0"]["mean"] == pytest.approx(one_seed[warm]["hr@10"] - one_seed["day0"]["hr@10"])
    n = result["test_users"]  # a [0, 1] variable's sample variance is at most p(1-p) n/(n-1)
    assert 0 <= result["se_hr10_per_user"] <= result["se_hr10"] * math.sqrt(n / (n - 1)) + 1e-12
    assert result["targets"]["warm_above_day0_by_more_than_one_se"] == (pairs["warm_minus_day0"]["in_se"] > 1)
    assert set(result["targets"]) == {
        "warm_within_one_se_of_cold_or_better",
        "warm_at_most_a_third_of_cold_time",
        "warm_at_most_a_third_of_cold_cpu_time",
        "warm_above_day0_by_more_than_one_se",
    }
