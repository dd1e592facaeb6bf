"""Quiet, readable output at our entry points: a tiny ``gr train`` + ``gr export`` in a subprocess
prints each log line once, none of the known third-party noise, one line per epoch."""

import logging
import re
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import yaml

from gr.console import KNOWN_LOG_LINES, quiet_console
from helpers.runs import recipe

ROOT = Path(__file__).resolve().parents[1]
KNOWN_NOISE = (
    "HeuristicalStorageReservation",
    "known issue with TorchRec's dense tensor size",
    "broadcast_buffers",
    "torchvision is not installed",
    "Initializing distributed",
    "Starting with 1 processes",
    "Tip: For seamless cloud logging",
)
LOG_PREFIX = re.compile(r"^(INFO|WARNING|ERROR|DEBUG)(:[\w.]+:|: | [\w.]+: )")


def _gr(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "gr", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def train_and_export_output(tmp_path_factory):
    root = tmp_path_factory.mktemp("quiet")
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(recipe(("trainer.enable_progress_bar", True), ("trainer.max_epochs", 2))))
    return _gr("train", "--config", str(config), "--out", str(root / "run")) + _gr(
        "export", str(root / "run"), str(root / "export")
    )


def test_each_log_line_is_printed_once(train_and_export_output):
    messages = [LOG_PREFIX.sub("", line) for line in train_and_export_output.splitlines() if LOG_PREFIX.match(line)]
    assert any("GPU available" in m for m in messages)
    assert [m for m, n in Counter(messages).items() if n > 1] == []


def test_known_third_party_noise_and_our_future_warning_are_gone(train_and_export_output):
    assert [noise for noise in KNOWN_NOISE if noise in train_and_export_output] == []


def test_progress_is_one_line_per_epoch_when_not_on_a_terminal(train_and_export_output):
    epochs = [line for line in train_and_export_output.splitlines() if line.startswith("epoch ")]
    assert [line.split(":")[0] for line in epochs] == ["epoch 1/2", "epoch 2/2"]
    assert all("train/loss=" in line and "val/" in line for line in epochs)
    assert "\r" not in train_and_export_output and "it/s" not in train_and_export_output


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
        assert [str(w.message) for w in caught] == ["some other deprecation"]
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
