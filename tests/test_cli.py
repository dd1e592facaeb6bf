"""The ``gr`` command: subcommand dispatch, the console script declaration, ``gr train --help``
listing every config key, ``--print-config`` and the ``train.py`` alias."""

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from gr.commands import cli
from gr.train.config import load_config
from gr.train.config_reference import config_keys

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def _leaf_paths(values: Any, prefix: str = "") -> Iterator[str]:
    """Dotted paths of a resolved config's leaves; list-of-mapping items as ``key[].field``."""
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in ("kwargs", "task_weights"):
            yield from _leaf_paths(value, f"{path}.")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value) and key == "tables":
            for item in value:
                yield from _leaf_paths(item, f"{path}[].")
        else:
            yield path


def test_usage_lists_every_subcommand(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for name in ("train", "export", "check", "serve", "rank", "generate", "plan", "data"):
        assert f"\n  {name} " in out


@pytest.mark.parametrize("argv,message", [(["fit"], "unknown command 'fit'"), (["data", "fetch"], "download")])
def test_unknown_subcommand_is_an_error_naming_the_choices(capsys, argv, message):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "name,prefix",
    [
        ("train", []),
        ("export", []),
        ("check", ["check"]),
        ("serve", ["serve"]),
        ("rank", ["rank"]),
        ("generate", ["generate"]),
        ("plan", []),
    ],
)
def test_each_subcommand_forwards_to_its_module_main(name, prefix):
    function, rest, error = cli.resolve([name, "x", "--y"])
    assert error == "" and callable(function) and function.__name__ == "main"
    assert function.__module__ == cli.COMMANDS[name].module and rest == [*prefix, "x", "--y"]


# Every command line as typed: each command, each subcommand of those that take one.
COMMAND_LINES = [[name] for name in cli.COMMANDS if name not in cli.SUBCOMMANDS] + [
    [name, sub] for name, (subs, _) in cli.SUBCOMMANDS.items() for sub in subs
]
# What a command imports only once its arguments parse (docs/design.md §3): seconds of start-up each.
HEAVY_STACKS = ("torch", "lightning", "torchrec", "fbgemm_gpu", "onnx", "onnxruntime", "fastapi", "uvicorn", "duckdb")
PARSE_EVERY_COMMAND_LINE = """
import contextlib, io, sys
from gr.commands import cli
for argv in {lines!r}:
    for extra in (["--help"], ["--no-such-option"], []):  # [] : a missing argument, for those that take one
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                status = cli.main([*argv, *extra])
            except SystemExit as exit_:
                status = exit_.code
        assert status == (0 if extra == ["--help"] else 2), (argv, extra, status)
print(sorted(name for name in {heavy!r} if name in sys.modules))
"""


def test_every_commands_help_and_usage_errors_come_before_torch_is_imported():
    """In one fresh interpreter, as ``gr`` starts: parsing alone must not pay torch's start-up."""
    code = PARSE_EVERY_COMMAND_LINE.format(lines=COMMAND_LINES, heavy=HEAVY_STACKS)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", COMMAND_LINES)
def test_each_commands_help_and_usage_errors_name_it_as_typed(capsys, argv):
    for extra, code, stream in ((["--help"], 0, "out"), (["--no-such-option"], 2, "err")):
        with pytest.raises(SystemExit) as exit_:
            cli.main([*argv, *extra])
        assert exit_.value.code == code
        assert getattr(capsys.readouterr(), stream).startswith(f"usage: gr {' '.join(argv)} "), extra


def test_gr_data_download_help_documents_the_licences(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["data", "download", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gr data download") and "GroupLens usage licence" in out


def test_pyproject_declares_the_gr_script_under_a_distribution_name_other_than_gr():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] != "gr"
    module, _, function = project["scripts"]["gr"].partition(":")
    assert getattr(sys.modules.get(module) or __import__(module, fromlist=[function]), function) is cli.main


def test_train_help_lists_every_config_key_with_type_and_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    documented = {k.path: k for k in config_keys()}
    resolved = set(_leaf_paths(load_config(QUICKSTART).to_dict()))
    assert resolved - set(documented) == set()
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and "default" in line}
    for path in resolved:
        assert documented[path].type in lines[path] and f"default {documented[path].default}" in lines[path]
    assert "trainer.max_epochs" in lines and "default 100" in lines["trainer.max_epochs"]
    assert "default 16 (0 under candidates: impressions" in lines["data.ranking.num_negatives"]


def test_print_config_prints_the_resolved_yaml_and_trains_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = cli.main(["train", "--config", str(QUICKSTART), "--print-config", "--trainer.max_epochs", "3"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert code == 0 and printed["trainer"]["max_epochs"] == 3
    assert printed == load_config(QUICKSTART, [("trainer.max_epochs", "3")]).to_dict()
    assert list(tmp_path.iterdir()) == []


def test_train_py_is_an_alias_of_gr_train(warm_python):
    argv = ["train.py", "--config", str(QUICKSTART), "--print-config", "--model.hstu.num_layers", "1"]
    done = warm_python.run(argv, cwd=ROOT, env=os.environ, timeout=120)  # a process of its own (helpers.warm)
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout)["model"]["hstu"]["num_layers"] == 1
