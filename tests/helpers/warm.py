"""Python scripts and ``-m`` modules run in a child forked from a warm interpreter, one that has
torch, Lightning, TorchRec and gr's training, export and serving code imported already (a
``multiprocessing`` fork server, started on first use). The child is a process of its own: its
own exit status (``os._exit`` and signals end only it), environment, working directory, stdout
and stderr, ``sys.argv`` and ``sys.path`` as ``python SCRIPT`` / ``python -m MODULE`` set them. It
skips the ~5 s a fresh interpreter spends importing that stack.

For tests whose promise is what a script does. A test about a fresh interpreter (which modules it
imports, what it prints while importing, a real terminal) keeps ``subprocess``. Environment
variables read when the preloaded packages are imported keep the fork server's values (those of
the pytest worker when it started it); ``OMP_NUM_THREADS`` is applied to torch in the child.
"""

import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
from multiprocessing import forkserver
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

PRELOAD = ["torch", "lightning", "torchrec", "gr.train.run", "gr.export", "gr.serving", "helpers.warm_exporter"]
TESTS = Path(__file__).resolve().parents[1]
FORKED_TORCHRUN = Path(__file__).with_name("forked_torchrun.py")


class WarmPython:
    """``run(argv, cwd, env, timeout)`` is ``subprocess.run([sys.executable, *argv], ...,
    capture_output=True, text=True)`` in a child of the fork server."""

    def __init__(self, base_path: Sequence[str]) -> None:
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD)
        self.base_path = list(base_path)  # a fresh interpreter's sys.path, without PYTHONPATH and script dir
        self.server_started = False

    def _start_server(self) -> None:
        """The fork server, with tests/ on its PYTHONPATH: Python 3.11's server does not take the
        parent's sys.path, and PRELOAD names a module of ``helpers``."""
        if self.server_started:
            return
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), before) if p)
        try:
            forkserver.ensure_running()
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before
        self.server_started = True

    def run(
        self, argv: Sequence[str], cwd: Path, env: Mapping[str, str], timeout: float
    ) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            child = self._start_child(argv, cwd, env, out, err)
            child.join(timeout)
            if child.is_alive():
                child.kill()
                child.join()
                raise subprocess.TimeoutExpired([sys.executable, *argv], timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(
                [sys.executable, *argv], child.exitcode, out.read_text(), err.read_text()
            )

    def start(self, argv: Sequence[str], cwd: Path, env: Mapping[str, str]) -> "WarmProcess":
        """``subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=PIPE, stderr=STDOUT,
        text=True)`` in a child of the fork server, left running."""
        handle, name = tempfile.mkstemp(prefix="gr-warm-", suffix=".out")
        os.close(handle)
        output = Path(name)
        return WarmProcess(self._start_child(argv, cwd, env, output, None), output)

    def _start_child(
        self, argv: Sequence[str], cwd: Path, env: Mapping[str, str], out: Path, err: Optional[Path]
    ) -> multiprocessing.process.BaseProcess:
        """The started child running ``python *argv``, its stdout in ``out``, its stderr in ``err``
        (None: in ``out`` too, interleaved as they are written)."""
        self._start_server()
        child = self.context.Process(
            target=_child,
            args=(list(argv), str(cwd), dict(env), self.base_path, str(out), None if err is None else str(err)),
        )
        child.start()
        return child

    def torchrun(
        self, nproc: int, argv: Sequence[str], cwd: Path, env: Mapping[str, str], timeout: float
    ) -> subprocess.CompletedProcess:
        """``torchrun --nproc_per_node NPROC *argv`` with its ranks forked from a warm child
        (``forked_torchrun.py``), as ``run`` returns it."""
        return self.run([str(FORKED_TORCHRUN), str(nproc), *argv], cwd, env, timeout)


class WarmProcess:
    """A child of the fork server as ``subprocess.Popen`` gives one started with ``stdout=PIPE,
    stderr=STDOUT, text=True``: ``pid``, ``poll``, ``wait``, ``terminate``, ``kill``, ``returncode``,
    and ``stdout``, what it printed (read it once it has ended)."""

    def __init__(self, process: multiprocessing.process.BaseProcess, output: Path) -> None:
        self.process = process
        self.pid = process.pid
        self.stdout = output.open()  # open before the file goes: what the child writes stays readable
        self.output = output

    @property
    def returncode(self) -> Optional[int]:
        return self.process.exitcode

    def poll(self) -> Optional[int]:
        if self.process.exitcode is not None:
            self.output.unlink(missing_ok=True)
        return self.process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self.process.join(timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
        return code

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()


def fresh_sys_path() -> List[str]:
    """``sys.path`` of a fresh interpreter started with ``-c`` and no PYTHONPATH, less its leading ''."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import json, sys; print(json.dumps(sys.path[1:]))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def _child(
    argv: List[str], cwd: str, env: Mapping[str, str], base_path: List[str], out: str, err: Optional[str]
) -> None:
    """In the forked child: the process state ``python *argv`` starts with, then run it."""
    # stdin: /dev/null on fd 0 (multiprocessing gives the child one on another descriptor, which a process it
    # spawns, uvicorn's workers, does not inherit)
    handle = os.open(os.devnull, os.O_RDONLY)
    os.dup2(handle, 0)
    os.close(handle)
    sys.stdin = open(0, closefd=False)  # fd 0 stays open: the process's stdin
    for fd, path in ((1, out), (2, err if err is not None else out)):
        if fd == 2 and err is None:
            os.dup2(1, 2)  # one open file: stdout and stderr interleaved as written
            continue
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[:] = [cwd, *extra, *base_path]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[:] = [str((Path(cwd) / argv[0]).resolve().parent), *extra, *base_path]
        runpy.run_path(argv[0], run_name="__main__")
