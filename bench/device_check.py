"""Validate a device host: the first command to run on a new GPU or NPU machine.

  python bench/device_check.py --device cuda               # or npu; report under runs/device-check-*/
  python bench/device_check.py --device cpu --smoke        # tiny sizes, every step in seconds (tests)

Steps, each a subprocess with ``GR_TEST_DEVICE=<device>`` whose output is kept in DIR/logs/:
  conformance   the attention and cached-attention conformance suites (pytest) on the device;
  attention     bench/attention.py: the device's backend (cpu: cpu, cuda: triton, npu: ascend)
                against the padded reference;
  serving       bench/serving.py: ranking through an export (the serving runtime itself runs on
                CPU until it takes a device);
  train_step    bench/train_step.py [--smoke]: the training step on the CPU path only (it has no device
                option yet), so a device host's report shows its host-side training speed.
DIR/report.json and DIR/report.md hold each step's status, time and summary (a bench's last JSON
line, the suite's counts), the device's name and the package versions. The last line printed is
one JSON object; the exit status is 1 when the device is unusable or a step failed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from gr.atomic import write_json, write_text
from gr.devices import DEVICES, autoload_env, cann_home, configure_backend_autoload, require_device

ROOT = Path(__file__).resolve().parents[1]
SUITES = ["tests/test_attention_conformance.py", "tests/test_attention_cached.py"]
SMOKE_CASES = "no-bias or plain-targets"  # one training case per backend, one cached case per backend
ATTENTION_BACKEND = {"cpu": "cpu", "cuda": "triton", "npu": "ascend"}
ATTENTION_SIZES = {
    "smoke": ["--batch", "4", "--mean-len", "32", "--max-len", "64", "--dim", "16", "--repeats", "1", "--threads", "1"],
    "small": ["--batch", "16", "--mean-len", "256", "--max-len", "1024", "--dim", "64", "--repeats", "3"],
}
SERVING_SIZES = {
    "smoke": [
        "--lengths",
        "32",
        "--candidates",
        "8",
        "--micro-batch",
        "8",
        "--repeats",
        "1",
        "--pointwise-budget",
        "0.2",
        "--clock",
        "thread",
    ],
    "small": ["--lengths", "256", "1024", "--candidates", "64", "512", "--repeats", "2"],
}
PACKAGES = (
    "torch",
    "triton",
    "triton-ascend",
    "torch-npu",
    "torchrec",
    "fbgemm-gpu",
    "fbgemm-gpu-cpu",
    "lightning",
    "onnx",
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-cann",
    "numpy",
)
LOG_TAIL_LINES = 8


@dataclass
class Step:
    """One check: its command, and once run its status (passed | failed | timeout | skipped),
    wall seconds, summary (a bench's last JSON line or the suite's counts), a note and its log."""

    name: str
    command: List[str]
    status: str = "skipped"
    seconds: float = 0.0
    summary: Optional[Dict[str, Any]] = None
    note: str = ""
    log: Optional[str] = None


def run_step(step: Step, env: Mapping[str, str], logs: Path, timeout_s: float, junit: Optional[Path] = None) -> Step:
    """Run ``step.command`` in the repository root; its output goes to ``logs/<name>.log``. With
    ``junit`` the summary is pytest's counts read from that JUnit XML file, else the last output
    line parsed as JSON (a bench's summary: none is a failure)."""
    start = time.perf_counter()
    try:
        run = subprocess.run(
            step.command,
            cwd=ROOT,
            env=dict(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout_s,
        )
        output, returncode = run.stdout, run.returncode
    except subprocess.TimeoutExpired as err:
        output, returncode = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or ""), None
    step.seconds = round(time.perf_counter() - start, 2)
    step.log = str(logs / f"{step.name}.log")
    write_text(step.log, output)
    tail = "\n".join(output.strip().splitlines()[-LOG_TAIL_LINES:])
    if returncode is None:
        step.status, step.note = "timeout", f"no result after {timeout_s:.0f} s; output ends:\n{tail}"
        return step
    step.summary = junit_counts(junit) if junit is not None and junit.is_file() else last_json_line(output)
    if returncode != 0:
        step.status, step.note = "failed", f"exit status {returncode}; output ends:\n{tail}"
    elif step.summary is None:
        step.status, step.note = "failed", f"exit status 0 but no JSON summary line; output ends:\n{tail}"
    else:
        step.status = "passed"
    return step


def last_json_line(output: str) -> Optional[Dict[str, Any]]:
    """The last non-empty line of ``output`` as a JSON object, or None."""
    lines = output.strip().splitlines()
    try:
        value = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def last_line(text: str) -> str:
    """The last non-empty line of ``text`` (a failed step's error), or ""."""
    lines = text.strip().splitlines()
    return lines[-1].strip() if lines else ""


def junit_counts(path: Path) -> Dict[str, int]:
    """Totals of a pytest JUnit XML report: tests, failures, errors, skipped."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}


def plan(device: str, smoke: bool, out: Path) -> List[Step]:
    """The steps of a check on ``device``, sized by ``smoke``."""
    size = "smoke" if smoke else "small"
    python = sys.executable
    pytest = [python, "-m", "pytest", *SUITES, "-p", "no:cacheprovider", f"--junitxml={out / 'conformance.xml'}"]
    if smoke:
        pytest += ["-k", SMOKE_CASES]
    steps = [
        Step("conformance", pytest),
        Step(
            "attention",
            [
                python,
                "bench/attention.py",
                "--device",
                device,
                "--backend",
                ATTENTION_BACKEND[device],
                *ATTENTION_SIZES[size],
            ],
        ),
        Step("serving", [python, "bench/serving.py", *SERVING_SIZES[size]]),
        Step("train_step", [python, "bench/train_step.py", *(["--smoke", "--no-epoch"] if smoke else [])]),
    ]
    if not (ROOT / "bench" / "train_step.py").is_file():
        steps[-1].note = "bench/train_step.py is not in this tree"
    return steps


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    if device == "npu":
        return torch.npu.get_device_name(0)
    cpuinfo = Path("/proc/cpuinfo")
    models = (
        [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
        if cpuinfo.is_file()
        else []
    )
    return f"{models[0] if models else platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def package_versions() -> Dict[str, str]:
    """Installed versions of the packages a device run depends on (absent ones left out)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def host_facts(device: str, usable: bool) -> Dict[str, Any]:
    """Python, OS, torch's CUDA version and CANN's home; torch is not imported for an unusable
    NPU (with torch_npu installed and CANN missing, ``import torch`` itself fails)."""
    facts = {"python": platform.python_version(), "platform": platform.platform()}
    if usable or device != "npu":
        import torch

        facts["torch_cuda"] = torch.version.cuda
    if device == "npu":
        facts["cann_home"] = cann_home()
    return facts


def markdown(report: Dict[str, Any]) -> str:
    lines = [
        f"# Device check: {report['device']} ({report['device_name']})",
        "",
        f"{report['started']}, {'smoke sizes' if report['smoke'] else 'small sizes'}: "
        f"**{'all steps passed' if report['ok'] else 'FAILED'}**",
        "",
    ]
    if report["device_error"]:
        lines += [f"Device unusable: {report['device_error']}", ""]
    lines += ["| step | status | seconds | note |", "|---|---|---|---|"]
    for step in report["steps"]:
        note = last_line(step["note"]).replace("|", "\\|")
        lines.append(f"| {step['name']} | {step['status']} | {step['seconds']} | {note} |")
    for step in report["steps"]:
        if step["summary"] is not None or step["note"]:
            lines += ["", f"## {step['name']}", "", f"`{shlex.join(step['command'])}`", ""]
            if step["summary"] is not None:
                lines += ["```json", json.dumps(step["summary"], indent=1), "```"]
            if step["note"]:
                lines += ["```", step["note"], "```"]
    lines += ["", "## Host and packages", "", "| name | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in {**report["host"], **report["packages"]}.items()]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", required=True, choices=DEVICES)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and a few conformance cases (seconds on CPU)")
    parser.add_argument("--out", type=Path, help="report directory (default: runs/device-check-DEVICE-TIME)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per step")
    args = parser.parse_args(argv)
    configure_backend_autoload(args.device)  # before torch: torch_npu loads only for npu
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    out = args.out or ROOT / "runs" / f"device-check-{args.device}-{time.strftime('%Y%m%d-%H%M%S')}"
    (out / "logs").mkdir(parents=True, exist_ok=True)

    steps = plan(args.device, args.smoke, out)
    try:
        require_device(args.device, "--device")
        error, name = None, device_name(args.device)
    except RuntimeError as err:
        error, name = str(err), "unavailable"
    env = {**os.environ, **autoload_env(args.device), "GR_TEST_DEVICE": args.device}
    for step in steps:
        if error is not None:
            step.note = "device unusable"
        elif not step.note:
            junit = out / "conformance.xml" if step.name == "conformance" else None
            run_step(step, env, out / "logs", args.timeout, junit)
        print(f"{step.name:<12} {step.status:<8} {step.seconds:>8.1f} s  {last_line(step.note)}", flush=True)

    ok = error is None and all(step.status in ("passed", "skipped") for step in steps)
    report = {
        "device": args.device,
        "device_name": name,
        "device_error": error,
        "smoke": args.smoke,
        "ok": ok,
        "started": started,
        "host": host_facts(args.device, error is None),
        "packages": package_versions(),
        "steps": [asdict(step) for step in steps],
    }
    write_json(out / "report.json", report)
    write_text(out / "report.md", markdown(report))
    print(
        json.dumps(
            {
                "bench": "device_check",
                "device": args.device,
                "device_name": name,
                "ok": ok,
                "report": str(out / "report.json"),
                "steps": {step.name: step.status for step in steps},
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
