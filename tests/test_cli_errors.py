"""Bad input to a command line ends in one line naming the file, exit status 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gr.cli_errors import USAGE_EXIT_STATUS, run_cli

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def one_error_line(done, prog):
    lines = done.stderr.strip().splitlines()
    assert done.returncode == USAGE_EXIT_STATUS, done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), done.stderr[-2000:]
    return lines[0]


def test_train_with_a_missing_data_path_names_the_file(tmp_path):
    done = run(
        "train.py",
        "--config",
        "configs/ml100k_hstu.yaml",
        "--data.path",
        str(tmp_path / "nowhere"),
        "--out",
        str(tmp_path / "run"),
    )
    assert str(tmp_path / "nowhere") in one_error_line(done, "gr train")


def test_export_of_a_missing_run_and_check_of_a_missing_export_name_the_directory(tmp_path):
    missing = str(tmp_path / "nowhere")
    assert missing in one_error_line(run("-m", "gr.export", missing, str(tmp_path / "export")), "python -m gr.export")
    assert missing in one_error_line(run("-m", "gr.export", "check", missing), "python -m gr.export")


@pytest.mark.parametrize("content", [b"\xff\xfe not utf-8", b"[" * 100_000 + b"]" * 100_000])
def test_non_utf8_or_deeply_nested_request_file_is_one_line(tmp_path, capsys, content):
    request = tmp_path / "request.json"
    request.write_bytes(content)
    assert run_cli("prog", lambda: json.loads(request.read_text(encoding="utf8"))) == USAGE_EXIT_STATUS
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prog: error: ")
