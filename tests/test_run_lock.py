"""One writer per run directory (``gr.utils.run_lock``): a second ``gr train`` / ``--resume`` into a run
being written, an export of it or a warm start from it, stops in one line and leaves the directory as it
was; the OS drops the lock of a process that dies."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gr.commands import cli
from gr.export.writer import export_run
from gr.utils.run_lock import LOCK_FILE, RunLockedError, run_lock, writes_run

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def listing(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def run_dir(tmp_path):
    """A run directory with a config.yaml and a checkpoint file, as a live run holds."""
    run = tmp_path / "run"
    (run / "checkpoints" / "epoch=0.tmp").mkdir(parents=True)
    (run / "checkpoints" / "epoch=0.tmp" / "__0_0.distcp").write_bytes(b"shard")
    (run / "config.yaml").write_text(QUICKSTART.read_text())
    return run


def one_error_line(capsys, prog: str) -> str:
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"{prog}: error: "), line
    return line


def test_a_second_train_into_a_run_being_written_is_one_line_and_touches_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    with run_lock(out, "gr train"):  # a run that has just started: nothing written yet but the lock
        held = listing(out)
        assert cli.main(["train", "--config", str(QUICKSTART), "--out", str(out)]) == 2
        assert listing(out) == held
    line = one_error_line(capsys, "gr train")
    assert f"{out}: in use by another process (pid {os.getpid()}: gr train); gr train stops here" in line
    assert not out.exists()  # the first writer created it and wrote nothing


def test_resuming_a_run_being_written_is_one_line_and_touches_nothing(run_dir, capsys):
    before = listing(run_dir)
    with run_lock(run_dir, "gr train"):
        held = listing(run_dir)
        assert cli.main(["train", "--resume", str(run_dir)]) == 2
        assert listing(run_dir) == held
    line = one_error_line(capsys, "gr train")
    assert f"{run_dir}: in use by another process (pid {os.getpid()}: gr train); gr train --resume stops" in line
    assert listing(run_dir) == before  # the lock file goes with its holder


def test_exporting_a_run_being_written_is_refused_and_writes_no_export(run_dir, tmp_path):
    with run_lock(run_dir, "gr train"):
        with pytest.raises(RunLockedError, match="gr export stops here"):
            export_run(run_dir, tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_a_warm_start_from_a_run_being_written_is_one_line_and_starts_nothing(run_dir, tmp_path, capsys):
    out = tmp_path / "warm"
    before = listing(run_dir)
    with run_lock(run_dir, "gr train"):
        argv = ["train", "--config", str(QUICKSTART), "--out", str(out), "--init-from", str(run_dir)]
        assert cli.main(argv) == 2
    line = one_error_line(capsys, "gr train")
    assert f"{run_dir}: in use by another process (pid {os.getpid()}: gr train); gr train --init-from stops" in line
    assert listing(run_dir) == before and not out.exists()


def test_exports_share_a_run_and_keep_writers_out(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with run_lock(run, "gr export", shared=True), run_lock(run, "gr export", shared=True):
        with pytest.raises(RunLockedError, match=r"another process \(gr export or gr train --init-from, reading it\)"):
            with run_lock(run, "gr train"):
                pass
    assert list(run.iterdir()) == []


def test_a_writer_removes_the_directories_it_created_when_it_wrote_nothing(tmp_path):
    with run_lock(tmp_path / "runs" / "new", "gr train"):
        assert (tmp_path / "runs" / "new" / LOCK_FILE).is_file()
    assert list(tmp_path.iterdir()) == []
    with run_lock(tmp_path / "runs" / "kept", "gr train"):
        (tmp_path / "runs" / "kept" / "config.yaml").write_text("written")
    assert [p.name for p in (tmp_path / "runs" / "kept").iterdir()] == ["config.yaml"]


def test_the_lock_of_a_killed_process_is_released(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from gr.utils.run_lock import run_lock\nwith run_lock({str(run)!r}, 'gr train'):\n"
            "    print('held', flush=True)\n    import time; time.sleep(60)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLockedError):
            with run_lock(run, "gr train"):
                pass
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        with run_lock(run, "gr train"):  # the stale .lock file is taken over
            assert (run / LOCK_FILE).read_text() == f"pid {os.getpid()}: gr train\n"
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_only_global_rank_zero_takes_the_lock():
    assert writes_run({}) and writes_run({"RANK": "0", "LOCAL_RANK": "0"})
    assert not writes_run({"RANK": "1"}) and not writes_run({"NODE_RANK": "1", "LOCAL_RANK": "0"})
