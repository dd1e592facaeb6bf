"""What the benchmarks report about the host and their own process, without importing torch: the CPU
(model and SIMD flags), the load average, and the process's peak resident set; and how a benchmark
runs one of its phases in a process of its own."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512", "amx", "avx_vnni")  # prefixes of the flags shown


def peak_resident_bytes() -> int:
    """This process's peak resident set so far (``VmHWM`` of /proc/self/status)."""
    with open("/proc/self/status", encoding="ascii") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmHWM:"))


def cpu() -> Tuple[str, List[str]]:
    """(model name, its SIMD flags among ``SIMD_FLAGS``) from /proc/cpuinfo."""
    lines = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines if ":" in line)}
    flags = [f for f in fields.get("flags", "").split() if f.startswith(SIMD_FLAGS)]
    return f"{fields.get('model name', 'unknown')} ({os.cpu_count()} cores)", flags


def load_average() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_python(
    argv: Sequence[str], forked: bool = False, cwd: Optional[Path] = None, capture: bool = True
) -> subprocess.CompletedProcess:
    """``python *argv`` (``SCRIPT ARGS...`` or ``-m MODULE ARGS...``) in a process of its own, in ``cwd``
    -> its exit status, and with ``capture`` its stdout and stderr (text; else they are this process's).

    A measured run starts a fresh interpreter: nothing the benchmark did before is in the phase's
    heap or its peak resident set. ``forked`` (a ``--smoke`` run, whose numbers mean nothing) runs
    it in a child forked from this process instead: the same code from the same command line,
    without the seconds of CPU a fresh interpreter spends importing torch, Lightning and gr when
    this process has them imported already (the test suite's warm interpreters do)."""
    command = [sys.executable, *argv]
    if not forked:
        return subprocess.run(command, capture_output=capture, text=True, cwd=cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                if capture:
                    os.dup2(out.fileno(), 1)
                    os.dup2(err.fileno(), 2)
                if cwd is not None:
                    os.chdir(cwd)
                if argv[0] == "-m":
                    sys.argv = [argv[1], *argv[2:]]
                    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
                else:
                    sys.argv = list(argv)
                    runpy.run_path(argv[0], run_name="__main__")
                code = 0
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        outputs = (out.read(), err.read()) if capture else (None, None)
        return subprocess.CompletedProcess(command, os.waitstatus_to_exitcode(status), *outputs)
