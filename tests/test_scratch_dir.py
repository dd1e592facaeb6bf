"""A scratch directory a process owns (a server's shared tier, its workers' metrics): removed when
closed, kept while its owner lives, and removed by the next one when its owner was killed."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from gr.utils.scratch_dir import OWNER_FILE, ScratchDirectory

ROOT = Path(__file__).resolve().parents[1]


def test_a_closed_scratch_directory_is_gone_and_closing_twice_does_nothing(tmp_path):
    scratch = ScratchDirectory("gr-tier-", tmp_path)
    (scratch.path / "tier.sqlite").write_bytes(b"x")
    assert scratch.path.parent == tmp_path and scratch.path.name.startswith("gr-tier-")
    scratch.close()
    scratch.close()
    assert not scratch.path.exists()


def test_a_new_scratch_directory_removes_one_a_killed_owner_left_and_keeps_a_live_ones(tmp_path):
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal, sys; from gr.utils.scratch_dir import ScratchDirectory; "
            "print(ScratchDirectory('gr-tier-', sys.argv[1]).path, flush=True); os.kill(os.getpid(), signal.SIGKILL)",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert killed.returncode == -signal.SIGKILL
    left = Path(killed.stdout.strip())
    assert (left / OWNER_FILE).is_file()
    live = ScratchDirectory("gr-tier-", tmp_path)
    foreign = tmp_path / "gr-tier-foreign"  # no owner file: not one of ours
    foreign.mkdir()
    other_prefix = ScratchDirectory("gr-metrics-", tmp_path)
    newer = ScratchDirectory("gr-tier-", tmp_path)
    assert not left.exists()
    assert live.path.is_dir() and foreign.is_dir() and newer.path.is_dir() and other_prefix.path.is_dir()
    for scratch in (live, newer, other_prefix):
        scratch.close()
