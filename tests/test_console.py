"""Quiet, readable output at our entry points: ``make demo``'s own commands (as ``make -n demo``
prints them, trained at a reduced size) print each log line once, no block of lines twice in a
row, no warning and none of the known third-party noise, and one line per epoch; ``gr export`` of
examples/custom_project prints no warning either."""

import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import List

import pytest
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from gr.export import onnx_graph_cache
from gr.utils.console import KNOWN_LOG_LINES, quiet_console
from helpers.movielens import CUSTOM_PROJECT, SMALL, small_ml_100k

ROOT = Path(__file__).resolve().parents[1]
KNOWN_NOISE = (
    "HeuristicalStorageReservation",
    "known issue with TorchRec's dense tensor size",
    "broadcast_buffers",
    "torchvision is not installed",
    "Initializing distributed",
    "Starting with 1 processes",
    "Tip: For seamless cloud logging",
    "deprecating ShardedTensor",
    "LeafSpec",
    "transfer_batch_to_device",
    "is_fx_tracing",
    "torch.distributed is disabled",
    "exists and is not empty",
)
LOG_PREFIX = re.compile(r"^(INFO|WARNING|ERROR|DEBUG)(:[\w.]+:|: | [\w.]+: )")
# A Python warning (``file.py:LINE: [Category: ]message``, Lightning's format too) or a torch log line.
WARNING_LINE = re.compile(r"^\S+\.py:\d+: |^\[rank\d+\]:[WE]\d{4} ")
# Two of quickstart's eight epochs: the demo's commands in seconds, with the same output.
DEMO_TRAIN_ARGS = "--trainer.max_epochs 2"


def demo_commands(run: Path, export: Path) -> List[str]:
    """``make demo``'s command lines, writing its run and export to ``run`` and ``export``: the
    Makefile is the one list of what the demo runs (``-o``: the .venv is taken as built)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    done = subprocess.run(
        ["make", "-s", "-n", "-o", ".venv/.installed", "demo", f"RUN={run}", f"EXPORT={export}"]
        + [f"DEMO_TRAIN_ARGS={DEMO_TRAIN_ARGS}", f"PY={sys.executable}", f"GR={sys.executable} -m gr"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.splitlines()


def _shell(command: str) -> str:
    """stdout and stderr of one command, interleaved as a terminal shows them, as on a fresh machine:
    ``gr export`` translates its graphs (and would print the translator's noise) instead of reusing
    the graphs this test run cached."""
    env = {**os.environ, onnx_graph_cache.CACHE_DIR_ENV: onnx_graph_cache.OFF}
    done = subprocess.run(
        command, shell=True, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300
    )
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def demo_output(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    commands = demo_commands(root / "run", root / "export")
    steps = ("gr train --config configs/quickstart.yaml", "gr export", "gr check", "examples/http_demo.py")
    assert [next(step for step in steps if step in c) for c in commands] == list(steps)
    return "".join(_shell(command) for command in commands)


def test_gr_export_of_the_custom_project_prints_no_warning_and_no_known_noise(tmp_path):
    """examples/custom_project reads two token features and three common ones (several inputs on
    one ONNX axis), and its export reads the run's data for the item store."""
    from gr.train.config import load_config
    from gr.train.run import train

    run = tmp_path / "run"
    data = str(small_ml_100k(tmp_path / "ml-100k"))
    train(load_config(CUSTOM_PROJECT, [("data.path", data), *SMALL]), run)
    output = _shell(f"{sys.executable} -m gr export {run} {tmp_path / 'export'}")
    assert [line for line in output.splitlines() if WARNING_LINE.match(line) or "Warning" in line] == []
    assert [noise for noise in KNOWN_NOISE if noise in output] == []
    assert (tmp_path / "export" / "sparse" / "item_features.safetensors").is_file()


def repeated_blocks(lines: List[str], longest: int = 8) -> List[List[str]]:
    """Blocks of 1..longest consecutive non-blank lines printed twice in a row (what a second log
    handler or a doubled warning prints)."""
    lines = [line for line in lines if line.strip()]
    found = []
    for size in range(1, longest + 1):
        for i in range(len(lines) - 2 * size + 1):
            if lines[i : i + size] == lines[i + size : i + 2 * size]:
                found.append(lines[i : i + size])
    return found


def test_each_log_line_is_printed_once(demo_output):
    messages = [LOG_PREFIX.sub("", line) for line in demo_output.splitlines() if LOG_PREFIX.match(line)]
    assert any("GPU available" in m for m in messages)
    assert [m for m, n in Counter(messages).items() if n > 1] == []


def test_known_third_party_noise_and_our_future_warning_are_gone(demo_output):
    assert [noise for noise in KNOWN_NOISE if noise in demo_output] == []


def test_the_demo_prints_no_warning_and_no_block_twice_in_a_row(demo_output):
    lines = demo_output.splitlines()
    assert [line for line in lines if WARNING_LINE.match(line)] == []
    assert repeated_blocks(lines) == []
    assert "OK" in demo_output and [line.split()[1] for line in lines if line.startswith("POST ")] == [
        "/v1/rank",
        "/v1/recommend",
        "/v1/generate",
    ]


def test_repeated_blocks_finds_a_doubled_line_or_block():
    assert repeated_blocks(["a", "b", "b", "c"]) == [["b"]]
    assert repeated_blocks(["a", "x", "y", "", "x", "y", "z"]) == [["x", "y"]]
    assert repeated_blocks(["a", "b", "a", "b"]) == [["a", "b"]]
    assert repeated_blocks(["a", "b", "c", "a"]) == []


def test_progress_is_a_line_per_epoch_and_per_logged_step_when_not_on_a_terminal(demo_output):
    lines = [line for line in demo_output.splitlines() if line.startswith("epoch ")]
    epochs = [line for line in lines if " step " not in line]
    assert [line.split(":")[0] for line in epochs] == ["epoch 1/2", "epoch 2/2"]
    assert all("train/loss=" in line and "val/" in line for line in epochs)
    steps = [line.split(":")[0] for line in lines if " step " in line]  # quickstart: 10 steps, logged every 5
    assert steps == ["epoch 1/2 step 5/10", "epoch 2/2 step 5/10"]
    assert "\r" not in demo_output and "it/s" not in demo_output


def test_filters_drop_only_the_known_messages(caplog):
    root = logging.getLogger()
    saved_handlers = list(root.handlers)
    loggers = {name: list(logging.getLogger(name).filters) for name in KNOWN_LOG_LINES}
    others = [h for h in saved_handlers if not getattr(h, "_gr_console", False)]  # an earlier test may have run ours
    root.handlers[:] = others
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            quiet_console()
            quiet_console()  # idempotent: still one handler of ours
            warnings.warn("HeuristicalStorageReservation is known to cause issues, ...", FutureWarning, stacklevel=1)
            warnings.warn("some other deprecation", FutureWarning, stacklevel=1)
            warnings.warn(
                "Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning, stacklevel=1
            )
            warnings.warn("Checkpoint directory /r/checkpoints exists and is not empty.", UserWarning, stacklevel=1)
            warnings.warn(
                "The number of training batches (2) is smaller than the logging interval Trainer(log_every_n_steps=4).",
                PossibleUserWarning,
                stacklevel=1,
            )
            warnings.warn("Checkpoint directory /r/checkpoints exists", UserWarning, stacklevel=1)
        assert [str(w.message) for w in caught] == [
            "some other deprecation",
            "Checkpoint directory /r/checkpoints exists",
        ]
        logging.getLogger("torch.fx._symbolic_trace").warning(
            "is_fx_tracing will return true for both fx.symbolic_trace and torch.export. Please use ..."
        )
        onnx = logging.getLogger("torch.onnx._internal.exporter._registration")
        onnx.warning("torchvision is not installed. Skipping %s", "torchvision::nms")
        onnx.warning("an unknown operator")
        logging.getLogger("lightning.fabric.utilities.distributed").warning(
            "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2"
        )  # two processes: kept
        assert [r.getMessage() for r in caplog.records] == [
            "an unknown operator",
            "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2",
        ]
        assert (
            len(root.handlers)
            == len([h for h in others if h.formatter is None or h.formatter._fmt != logging.BASIC_FORMAT]) + 1
        )
    finally:
        root.handlers[:] = saved_handlers
        for name, filters in loggers.items():
            logging.getLogger(name).filters[:] = filters


def test_other_ranks_print_only_errors_of_ours(monkeypatch, capsys):
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    loggers = {name: list(logging.getLogger(name).filters) for name in KNOWN_LOG_LINES}
    root.handlers[:] = [h for h in saved_handlers if not getattr(h, "_gr_console", False)]
    monkeypatch.setenv("RANK", "1")
    try:
        with warnings.catch_warnings():
            quiet_console()
        root.setLevel(logging.INFO)
        logging.getLogger("gr.data.readers").warning("ml-100k: dropped 3 duplicate interactions")
        logging.getLogger("gr.train").error("rank 1: out of memory")
        logging.getLogger("elsewhere").warning("a library's own warning")
        printed = capsys.readouterr().err.splitlines()
        assert printed == ["ERROR gr.train: rank 1: out of memory", "WARNING elsewhere: a library's own warning"]
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        for name, filters in loggers.items():
            logging.getLogger(name).filters[:] = filters
