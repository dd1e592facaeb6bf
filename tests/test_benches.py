"""Benchmarks cannot rot: every bench/*.py runs at its ``--smoke`` size in a process of its own (a
child of a warm interpreter, ``helpers.warm``, unless it needs a fresh one) and its last stdout line
is one JSON object holding the keys its docstring promises.

One ``Bench`` row per benchmark (path, extra arguments, promised keys); adding a benchmark
is adding a row, and ``test_every_benchmark_has_a_smoke_entry`` fails until it is added. An
argument ``{runs}`` is a directory the module's smoke runs share: the generation bench trains and
exports its smoke model there, and the DejaVu bench, which measures that model, reuses it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

import pytest

from helpers.warm import WarmPython

ROOT = Path(__file__).resolve().parents[1]
NOT_BENCHMARKS = {"smoke.py", "_peak.py", "_host.py", "_stats.py"}  # modules the benchmarks import
TIMEOUT_S = 300  # generous: the machine is shared; a quiet one runs the whole table in well under a minute
# Run by tests/test_benches_training.py: a second module, so the suite's two workers share the smoke runs.
TRAINING_BENCHES = {
    "cold_start",
    "train_step",
    "ab_steps",
    "memory",
    "train_dedup",
    "bench_data",
    "data_scale",
    "prepared_vs_raw",
    "new_users",
    "eval_cost",
    "delta_deploy",
    "export_graphs",
}


@dataclass(frozen=True)
class Bench:
    path: str
    keys: Tuple[str, ...]
    args: Tuple[str, ...] = ()
    xfail: str = ""  # why it cannot run at --smoke size today (the test then must fail: strict)
    covered_by: str = ""  # a test module that already runs it at --smoke size and checks its output
    fresh: str = ""  # why it needs a fresh interpreter (a subprocess) rather than a child of the warm one


BENCHES = (
    Bench(
        "bench/attention.py",
        (
            "device",
            "backend",
            "dtype",
            "shape",
            "threads",
            "load_average",
            "fwd_speedup_vs_padded",
            "fwd_bwd_speedup_vs_padded",
            "fwd_ms",
            "fwd_bwd_ms",
            "first_fwd_s",
            "first_fwd_bwd_s",
            "fwd_gflops",
            "fwd_bwd_gflops",
            "matmul_peak_gflops",
            "peak_dtype",
            "fwd_fraction_of_peak",
            "fwd_bwd_fraction_of_peak",
            "padded_fwd_fraction_of_peak",
            "max_relative_error",
        ),
        ("--threads", "1"),
    ),
    Bench(
        "bench/memory.py",
        ("bench", "model", "cases", "table_model", "tables", "ratios", "cpu", "cpu_flags", "load_average"),
    ),
    Bench(
        "bench/train_dedup.py",
        (
            "config",
            "ranks",
            "steps",
            "batch_size",
            "item_ids_per_rank_batch",
            "distinct_item_ids_per_rank_batch",
            "no_dedup_samples_per_s",
            "dedup_samples_per_s",
            "no_dedup_tokens_per_s",
            "dedup_tokens_per_s",
            "no_dedup_sparse_ms_per_batch",
            "dedup_sparse_ms_per_batch",
            "train_speedup",
            "sparse_speedup",
        ),
    ),
    Bench(
        "bench/bench_data.py",
        (
            "lines",
            "parse_seconds_pyarrow",
            "parse_seconds_python_loop",
            "parse_speedup",
            "build_sequences_seconds",
            "retrieval_train_batches_per_second",
            "ranking_train_batches_per_second",
        ),
    ),
    Bench(
        "bench/data_scale.py",
        (
            "bench",
            "memory_limit",
            "steps",
            "sizes",
            "raw_smallest",
            "ratios",
            "ranks",
            "targets",
            "cpu",
            "cpu_flags",
            "load_average",
        ),
    ),
    Bench(
        "bench/prepared_vs_raw.py",
        (
            "bench",
            "users",
            "interactions",
            "split_time",
            "shuffle_buffer",
            "test_users",
            "raw",
            "prepared",
            "prepare_s",
            "se_hr10",
            "prepared_minus_raw",
            "prepared_minus_raw_in_se",
            "train_time_ratio",
            "same_val_curve",
            "targets",
            "cpu",
            "load_average",
        ),
    ),
    Bench("bench/generate.py", ("speedup_over_greedy", "details"), ("--runs-dir", "{runs}")),
    Bench(
        "bench/retrieval_index.py",
        (
            "items",
            "speedup_exact_speculative",
            "speedup_ivf_speculative",
            "rollbacks_per_request",
            "mismatches",
            "search_ms",
        ),
    ),
    Bench("bench/dejavu.py", ("smoke",), ("--runs-dir", "{runs}")),
    Bench(
        "bench/serving.py",
        (
            "bench",
            "clock",
            "load_average_1min",
            "model",
            "cache_bytes_per_token",
            "ratios",
            "streaming",
            "batching",
            "retrieval",
        ),
    ),
    Bench("bench/serving_state.py", ("bench", "clock", "cpu", "load_average", "extend", "generate", "memory")),
    Bench("bench/paged_attention.py", ("bench", "clock", "cpu", "load_average", "shapes")),
    Bench("bench/serving_tier.py", ("bench", "clock", "cpu", "load_average", "line", "zipf")),
    Bench("bench/new_item_placement.py", ("bench", "cpu", "load_average", "dim", "sizes", "selection")),
    Bench("bench/serving_http.py", ("history", "candidates", "in_process", "http", "http_p50_overhead_at_1_client")),
    Bench(
        "bench/train_step.py",
        (
            "users",
            "steps",
            "threads",
            "peak_gflops",
            "epochs",
            "small/32-true/samples_per_s",
            "small/bf16-mixed/samples_per_s",
            "small/bf16_speedup",
            "small/32-true/epoch_s",
            "small/32-true/loop_step_ms",
            "small/32-true/loop_peak_fraction",
            "peak_gflops_end",
            "small/32-true+token/samples_per_s",
            "small/speedup_over_token_negatives",
        ),
        ("--recipes", "small", "--token-negatives", "--epochs", "2"),
    ),
    Bench(
        "bench/ab_steps.py",
        (
            "recipe",
            "precision",
            "users",
            "rounds",
            "steps",
            "this_ms",
            "other_ms",
            "this_median_ms",
            "other_median_ms",
            "median_ratio",
            "mean_ratio",
            "this_faster_rounds",
            "load_before",
            "load_after",
        ),
    ),
    Bench("bench/device_check.py", (), covered_by="tests/test_device_check.py"),
    Bench("bench/daily_retrain.py", (), covered_by="tests/test_daily_retrain_bench.py"),
    Bench("bench/delta_deploy.py", ("bench", "ml100k", "synthetic", "targets", "load_average")),
    Bench(
        "bench/cold_start.py",
        (
            "held_out",
            "events",
            "a_among_held_out",
            "a_whole_catalogue",
            "b_new_users",
            "c_other_events",
            "paired_hr@10",
            "placement",
            "top10_share_held_out",
            "target_share_held_out",
            "share_ratio",
            "targets",
            "cpu",
            "cpu_flags",
            "load_average",
        ),
    ),
    Bench(
        "bench/export_graphs.py",
        (
            "bench",
            "config",
            "seconds",
            "cpu_seconds",
            "fresh_over_reused",
            "fresh_over_reused_cpu",
            "identical",
            "cache_bytes",
            "threads",
            "cpu",
            "cpu_flags",
            "load_average",
        ),
    ),
    Bench(
        "bench/eval_cost.py",
        (
            "users",
            "interactions",
            "max_seq_len",
            "eviction_block",
            "test_targets",
            "tokens",
            "seconds",
            "cpu_seconds",
            "all_over_next",
            "export_over_next",
            "cpu_all_over_next",
            "cpu_export_over_next",
            "tokens_all_over_next",
            "hr@10",
            "export_metric_difference",
            "targets",
            "threads",
            "cpu",
            "cpu_flags",
            "load_average",
        ),
    ),
    Bench(
        "bench/new_users.py",
        (
            "held_out_users",
            "users",
            "unknown_items",
            "epochs",
            "scorers",
            "paired",
            "new_user_over_popularity",
            "targets",
            "cpu",
            "cpu_flags",
            "load_average",
        ),
    ),
    Bench(
        "bench/triton_compile.py",
        (
            "bench",
            "arch",
            "triton",
            "variants",
            "launches",
            "max_compile_s",
            "total_compile_s",
            "spills",
            "max_registers",
            "max_shared_bytes",
            "load_average",
        ),
        ("--arch", "sm_90"),
        fresh="it drops TRITON_INTERPRET before gr's kernels are imported; the warm interpreter's are interpreted",
    ),
)


def test_smoke_size_fills_only_the_arguments_not_given():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import smoke
    finally:
        sys.path.remove(str(ROOT / "bench"))

    def parse(argv):
        parser = argparse.ArgumentParser()
        parser.add_argument("--batch", type=int, default=32)
        parser.add_argument("--repeats", type=int, default=3)
        return vars(smoke.parse_args(parser, {"batch": 4, "repeats": 1}, argv)[0])

    assert parse([]) == {"batch": 32, "repeats": 3, "smoke": False}
    assert parse(["--smoke"]) == {"batch": 4, "repeats": 1, "smoke": True}
    assert parse(["--smoke", "--batch", "8"]) == {"batch": 8, "repeats": 1, "smoke": True}


def test_every_benchmark_has_a_smoke_entry():
    on_disk = {p.relative_to(ROOT).as_posix() for p in (ROOT / "bench").glob("*.py") if p.name not in NOT_BENCHMARKS}
    assert on_disk == {b.path for b in BENCHES}


def smoke_params(training: bool) -> list:
    """One pytest param per benchmark of the group (``TRAINING_BENCHES`` or the others) that no
    other test module covers."""
    return [
        pytest.param(b, id=Path(b.path).stem, marks=[pytest.mark.xfail(reason=b.xfail, strict=True)] if b.xfail else [])
        for b in BENCHES
        if not b.covered_by and (Path(b.path).stem in TRAINING_BENCHES) == training
    ]


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory) -> Path:
    """The ``{runs}`` directory of this module's smoke runs."""
    return tmp_path_factory.mktemp("bench_runs")


@pytest.mark.parametrize("bench", smoke_params(training=False))
def test_benchmark_smoke_run_ends_with_its_promised_json(bench, warm_python, smoke_runs):
    check_smoke_run(bench, warm_python, smoke_runs)


def check_smoke_run(bench: Bench, warm_python: WarmPython, runs: Path) -> None:
    """Run ``bench`` at its ``--smoke`` size (``{runs}`` in its arguments: ``runs``); its last
    stdout line is a JSON object with its keys."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
    }
    argv = [bench.path, "--smoke", *(arg.format(runs=runs) for arg in bench.args)]
    if bench.fresh:
        run = subprocess.run(
            [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    else:
        run = warm_python.run(argv, cwd=ROOT, env=env, timeout=TIMEOUT_S)
    assert run.returncode == 0, f"{bench.path} --smoke failed:\n{run.stderr[-3000:]}"
    lines = run.stdout.strip().splitlines()
    assert lines, f"{bench.path} --smoke printed nothing"
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    missing = [k for k in bench.keys if k not in result]
    assert not missing, f"{bench.path}: last line lacks {missing}: {lines[-1][:500]}"


def test_ab_steps_names_an_against_path_that_is_not_a_checkout(tmp_path):
    run = subprocess.run(
        [sys.executable, "bench/ab_steps.py", "--against", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert run.returncode == 2
    assert f"--against {tmp_path}: expected a gr checkout (with gr/ and bench/train_dedup.py)" in run.stderr
