"""Bad input to a command line ends in one line naming the file (or config key), exit status 2: also a
host without the accelerator asked for, and a model that cannot fit in this machine's memory."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gr.commands import cli
from gr.utils.cli_errors import USAGE_EXIT_STATUS, run_cli
from gr.utils.devices import npu_present

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def one_error_line(done, prog):
    lines = done.stderr.strip().splitlines()
    assert done.returncode == USAGE_EXIT_STATUS, done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), done.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["--config", "configs/ml100k_hstu.yaml", "--data.path", "{tmp}/nowhere"], "{tmp}/nowhere/u.data"),
        (["--config", "configs/ml100k_hstu.yaml", "--data.prepared", "{tmp}/nowhere"], "data.prepared: {tmp}/nowhere"),
    ],
)
def test_train_with_missing_data_names_it_before_importing_the_training_stack(tmp_path, overrides, named):
    argv = ["train", *(arg.format(tmp=tmp_path) for arg in overrides), "--out", str(tmp_path / "run")]
    code = (
        f"import sys; from gr.commands import cli; status = cli.main({argv!r}); "
        "print('lightning' in sys.modules); sys.exit(status)"
    )
    done = run("-c", code)
    assert named.format(tmp=tmp_path) in one_error_line(done, "gr train")
    assert done.stdout.strip() == "False" and not (tmp_path / "run").exists()


def test_export_of_a_missing_run_and_check_of_a_missing_export_name_their_command_and_the_directory(
    tmp_path, warm_python
):
    missing = str(tmp_path / "nowhere")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args, prog in (
        (["-m", "gr.export", missing, str(tmp_path / "export")], "gr export"),
        (["-m", "gr.export", "check", missing], "gr check"),
    ):
        done = warm_python.run(args, cwd=ROOT, env=env, timeout=120)  # a process of its own (helpers.warm)
        assert missing in one_error_line(done, prog)


@pytest.mark.parametrize("content", [b"\xff\xfe not utf-8", b"[" * 100_000 + b"]" * 100_000])
def test_non_utf8_or_deeply_nested_request_file_is_one_line(tmp_path, capsys, content):
    request = tmp_path / "request.json"
    request.write_bytes(content)
    assert run_cli("prog", lambda: json.loads(request.read_text(encoding="utf8"))) == USAGE_EXIT_STATUS
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prog: error: ")


QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def train_error_line(capsys, out: Path, *overrides: str) -> str:
    """``gr train`` of the quickstart recipe with ``overrides`` into ``out``, in this process: one
    error line, after gr's info lines about what was read when the error comes later."""
    assert cli.main(["train", "--config", str(QUICKSTART), "--out", str(out), *overrides]) == USAGE_EXIT_STATUS
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if not line.startswith("INFO gr.")]
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("gr train: error: "), line
    return line


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (("--trainer.accelerator", "gpu"), "trainer.accelerator: 'cuda' needs a CUDA build of torch and a visible GPU"),
        (
            ("--trainer.accelerator", "npu", "--sparse.placement", "host"),
            "trainer.accelerator: 'npu' needs the torch_npu package",
        ),
    ],
)
def test_an_accelerator_this_host_lacks_is_one_line_before_anything_is_written(tmp_path, capsys, overrides, expected):
    if overrides[1] == "gpu" and torch.cuda.is_available() or overrides[1] == "npu" and npu_present():
        pytest.skip(f"this host has the {overrides[1]}")
    assert expected in train_error_line(capsys, tmp_path / "run", *overrides)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "override, key",
    [
        (("--model.hstu.max_seq_len", "1000000000"), "model.hstu.max_seq_len 1,000,000,000 (positions)"),
        (("--model.tables.0.num_embeddings", "100000000000"), "num_embeddings 100,000,000,000 x embedding_dim 32"),
        (("--model.tables.0.embedding_dim", "100000000"), "embedding_dim 100,000,000"),
        (("--model.hstu.hidden_dim", "1000000"), "hidden_dim 1,000,000"),
    ],
)
def test_a_model_that_cannot_fit_in_memory_is_refused_before_it_is_built(tmp_path, capsys, monkeypatch, override, key):
    import gr.train.run as run

    def never_built(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(run, "GRTrainingModule", never_built)
    started = time.perf_counter()
    line = train_error_line(capsys, tmp_path / "runs" / "x", "--trainer.accelerator", "cpu", *override)
    assert time.perf_counter() - started < 60
    assert "the run does not fit in memory: gr plan estimates" in line and "GiB available (MemAvailable)" in line
    assert key in line and "trainer.memory_check: false" in line
    assert list(tmp_path.iterdir()) == []  # no runs/x, no runs/x/logs


def written_inputs(root: Path) -> Path:
    """Under ``root``: data/events.csv, recipe.yaml (a csv source reading it), link -> data, and run/
    (the config.yaml and features.json gr export reads first); -> root."""
    (root / "data").mkdir()
    rows = [f"{u},{i},{1000 + 60 * i}" for u in range(6) for i in range(5)]
    (root / "data" / "events.csv").write_text("\n".join(["user_id,item_id,timestamp", *rows]) + "\n")
    (root / "recipe.yaml").write_text(f"data:\n  source: csv\n  path: {root / 'data' / 'events.csv'}\n")
    (root / "link").symlink_to(root / "data")
    (root / "run").mkdir()
    (root / "run" / "config.yaml").write_text(QUICKSTART.read_text())
    (root / "run" / "features.json").write_text(json.dumps({"spec": {"sequence": {"item_id": 301}}, "tasks": []}))
    return root


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["data", "prepare", "--config", "{tmp}/recipe.yaml", "--out", "{tmp}/link", "--overwrite"],
            "--out {tmp}/link: holds data.path {tmp}/data/events.csv, which this command reads",
        ),
        (
            ["data", "prepare", "--config", "{tmp}/recipe.yaml", "--out", "{tmp}/data/../recipe.yaml", "--overwrite"],
            "--out {tmp}/data/../recipe.yaml: is --config {tmp}/recipe.yaml, which this command reads",
        ),
        (
            ["train", "--config", "{root}/configs/ml100k_hstu.yaml", "--data.path", "{tmp}/link"]
            + ["--out", "{tmp}/data/r"],
            "--out {tmp}/data/r: is inside data.path {tmp}/link ({tmp}/data), which this command reads",
        ),
        (["export", "{tmp}/run", "{tmp}/run/export"], "EXPORT_DIR {tmp}/run/export: is inside RUN_DIR {tmp}/run"),
        (["export", "{tmp}/run", "{tmp}", "--overwrite"], "EXPORT_DIR {tmp}: holds RUN_DIR {tmp}/run"),
    ],
)
def test_an_output_that_is_holds_or_lies_inside_an_input_is_one_line_naming_both(tmp_path, capsys, argv, expected):
    before = sorted(written_inputs(tmp_path).rglob("*"))
    assert cli.main([arg.format(tmp=tmp_path, root=ROOT) for arg in argv]) == USAGE_EXIT_STATUS
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"gr {argv[0]}") and expected.format(tmp=tmp_path) in line, line
    assert sorted(tmp_path.rglob("*")) == before


def test_an_out_that_links_to_nothing_is_one_line_naming_the_link(tmp_path, capsys):
    written_inputs(tmp_path)
    (tmp_path / "out").symlink_to(tmp_path / "missing" / "prepared")
    argv = ["data", "prepare", "--config", str(tmp_path / "recipe.yaml"), "--out", str(tmp_path / "out")]
    assert cli.main(argv) == USAGE_EXIT_STATUS
    assert capsys.readouterr().err == (
        f"gr data prepare: error: --out {tmp_path / 'out'}: a symbolic link to {tmp_path / 'missing' / 'prepared'}, "
        "which does not exist; name a directory to write, or point the link at an existing one\n"
    )
    assert not (tmp_path / "missing").exists()
