"""Progress you can watch: step lines with throughput and ETA in a log, Lightning's bar on a
terminal (one without a size included) drawn as the run trains, with its validation metrics and the
log lines' epoch count, and throughput, learning rate and gradient norm in the run's logged metrics."""

import contextlib
import csv
import io
import math
import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gr.train import train
from gr.train.config import TrainConfig
from helpers.runs import recipe

ROOT = Path(__file__).resolve().parents[1]
LOGGED = recipe(("trainer.max_epochs", 1), ("trainer.enable_progress_bar", True), ("trainer.log_every_n_steps", 2))


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """(run directory, what it printed) of one LOGGED run, its output a StringIO (not a terminal)."""
    out = tmp_path_factory.mktemp("logged")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        train(TrainConfig.from_dict(LOGGED), out)
    return out, printed.getvalue()


def test_a_log_gets_a_line_every_logged_step_with_throughput_and_eta_and_one_per_epoch(logged_run):
    _, out = logged_run
    steps = re.findall(
        r"^epoch 1/1 step (\d+)/(\d+): train/loss=[\d.]+ samples/s=\d+ tokens/s=\d+ \([\d.]+s, ETA [\d.]+s\)$",
        out,
        flags=re.MULTILINE,
    )
    total = int(steps[0][1])
    assert [int(done) for done, _ in steps] == list(range(2, total, 2))  # the last step's numbers end the epoch
    assert re.search(r"^epoch 1/1: train/loss=[\d.]+ val/hr@10=[\d.]+ .*\([\d.]+s\)$", out, flags=re.MULTILINE)


def test_throughput_learning_rate_and_gradient_norm_are_logged_every_logged_step(logged_run):
    run_dir, _ = logged_run
    with open(run_dir / "logs" / "metrics.csv", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("train/loss")]
    assert len(rows) >= 2
    for row in rows:
        for name in ("train/samples_per_s", "train/tokens_per_s", "train/grad_norm"):
            assert math.isfinite(float(row[name])) and float(row[name]) > 0, (name, row)
        assert float(row["train/tokens_per_s"]) > float(row["train/samples_per_s"])  # sequences of several tokens
        assert math.isclose(float(row["train/lr"]), LOGGED["optimizer"]["lr"], rel_tol=1e-6)


def test_a_terminal_without_a_size_shows_the_bar_as_it_trains_epochs_from_1_with_validation_metrics(tmp_path):
    """A pty as `script` or a CI runner opens it: 0 columns, where tqdm alone draws nothing. The bar
    arrives step by step while the run trains, counts epochs from 1 as the log lines do, and shows
    the monitored validation metric after the loss once validation has run."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(LOGGED))
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    leader, follower = pty.openpty()  # a new pty reports 0 columns and 0 rows
    run = tmp_path / "run"
    command = [sys.executable, "-m", "gr", "train", "--config", str(config), "--out", str(run)]
    process = subprocess.Popen(command, stdin=follower, stdout=follower, stderr=follower, env=env, cwd=ROOT)
    os.close(follower)
    screen, while_training, deadline = b"", None, time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the pty
            break
        if not chunk:
            break
        screen += chunk
        if while_training is None and b"samples/s=" in screen:  # the first step's numbers
            while_training = process.poll() is None and not (run / "metrics.json").exists()
    os.close(leader)
    assert process.wait(timeout=60) == 0, screen.decode(errors="replace")[-3000:]
    text = screen.decode(errors="replace")
    assert while_training, text[-3000:]  # drawn as it happens, not when the run ends
    number = r"[\d.]+(?:e[+-]\d+)?"  # tqdm writes a postfix number of 1,000 or more as 1.25e+3
    done = rf"Epoch 1/1: 100%\|.*\| (\d+)/\1 \[.*loss={number}, val/ndcg@5={number}, samples/s={number}, tokens/s="
    assert re.search(done, text), text[-3000:]
    assert "Epoch 0" not in text and "epoch 1/1 step" not in text  # lines are for logs, not terminals
