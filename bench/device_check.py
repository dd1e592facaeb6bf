"""Validate a device host: the first command to run on a new GPU or NPU machine.

  python bench/device_check.py --device cuda               # or npu; report under runs/device-check-*/
  python bench/device_check.py --device cpu --smoke        # tiny sizes, every step in seconds (tests)

Steps, each a subprocess with ``GR_TEST_DEVICE=<device>`` whose output is kept in DIR/logs/:
  conformance     the attention and cached-attention conformance suites (pytest) on the device, with
                  the kernels' default tiles (``GR_TRITON_AUTOTUNE=0``): its cases share their
                  compiled kernels (one per bias parts, dtype and pass); --smoke: a few cases;
  attention_*     bench/attention.py: the device's backend (cpu: cpu, cuda: triton, npu: ascend)
                  against the padded reference in bf16 (fp32 on CPU), at the ML-1M recipe's shape
                  and at a long-history shape (16 histories of 1024 to 2048): ms, GFLOP/s and the
                  fraction of the matmul peak measured in the same run, first call (compile and
                  autotuning) included apart;
  train_*         the training step of a recipe on the device with ``sparse.backend: torch`` (no
                  TorchRec needed): configs/ml1m_hstu.yaml (on ML-1M-shaped synthetic ratings),
                  again in a second process (the kernel compile and autotuning caches warm), and
                  configs/generation_long.yaml (1024-token histories): first step's seconds
                  (compile included), then ms a step, tokens/s and the HSTU stack's useful FLOPs
                  as a fraction of the device's bf16 matmul peak (fp32 on CPU); --smoke: a tiny
                  synthetic recipe;
  serving         tests/test_device_end_to_end.py: a run trained on the device, exported and served
                  on the device (ONNX Runtime's provider, the HSTU engine and its KV cache there),
                  reproducing the run's predictions with the cache.
``--only STEP[,STEP]`` runs those steps alone. Steps run one after another within ``--budget``
seconds (default 480), each for ``--timeout`` seconds at most; a step not started in time is
reported as not run. Compiled kernels (Triton's cache) and autotuning results
(``GR_TRITON_CACHE_DIR``) are kept in DIR/cache/ and shared by the steps. DIR/report.json and
DIR/report.md hold each step's status, time and summary (a bench's last JSON line, the suite's
counts), the device's name and the package versions. The last line
printed is one JSON object; the exit status is 1 when the device is unusable or a step did not pass.

``--train-step CONFIG`` runs one training-step measurement in this process (what the train_*
steps run) and prints its JSON line.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gr.utils.atomic import write_json, write_text  # noqa: E402
from gr.utils.devices import DEVICES, autoload_env, cann_home, configure_backend_autoload, require_device  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SUITES = ["tests/test_attention_conformance.py", "tests/test_attention_cached.py"]
SMOKE_CASES = "no-bias or plain-targets"  # one training case per backend, one cached case per backend
ATTENTION_BACKEND = {"cpu": "cpu", "cuda": "triton", "npu": "ascend"}
ATTENTION_SHAPES = {  # step name -> bench/attention.py arguments after --device/--backend
    "smoke": {"attention": ["--smoke", "--threads", "1"]},
    "device": {
        "attention_ml1m": ["--dtype", "bf16", "--shape", "ml1m", "--repeats", "5", "--peak-size", "8192"],
        "attention_long": ["--dtype", "bf16", "--shape", "long", "--repeats", "5", "--peak-size", "8192"],
    },
}
ML1M = "configs/ml1m_hstu.yaml"
TRAIN_RECIPES = {  # step name -> (recipe, training steps timed after the first)
    "smoke": {"train": ("smoke", 2)},
    "device": {
        "train_ml1m": (ML1M, 20),
        "train_ml1m_again": (ML1M, 5),
        "train_long": ("configs/generation_long.yaml", 10),
    },
}
# --smoke's recipe: tiny synthetic retrieval that trains a step in about a second
SMOKE_RECIPE = {
    "data": {
        "source": "synthetic",
        "task": "retrieval",
        "max_seq_len": 20,
        "batch_size": 16,
        "item_features": False,
        "user_features": False,
        "synthetic": {"num_users": 64, "num_items": 50, "min_len": 5, "max_len": 20},
    },
    "model": {
        "hstu": {"hidden_dim": 16, "num_layers": 1, "num_heads": 1, "attention_dim": 8, "linear_dim": 8},
        "tables": [{"name": "item", "embedding_dim": 16, "features": ["item_id"]}],
    },
    "task": {"retrieval": {"num_negatives": 8}},
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
    env: Dict[str, str] = field(default_factory=dict)  # set for this step only
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
            env={**env, **step.env},
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
    size = "smoke" if smoke else "device"
    python = sys.executable
    pytest = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    conformance = [*pytest, *SUITES, f"--junitxml={out / 'conformance.xml'}"]
    if smoke:
        conformance += ["-k", SMOKE_CASES]
    steps = [Step("conformance", conformance, env={"GR_TRITON_AUTOTUNE": "0"})]
    backend = ["--device", device, "--backend", ATTENTION_BACKEND[device]]
    for name, args in ATTENTION_SHAPES[size].items():
        steps.append(Step(name, [python, "bench/attention.py", *backend, *args]))
    for name, (recipe, timed) in TRAIN_RECIPES[size].items():
        steps.append(
            Step(
                name,
                [python, "bench/device_check.py", "--train-step", recipe, "--device", device, "--steps", str(timed)],
            )
        )
    serving = [*pytest, "tests/test_device_end_to_end.py", f"--junitxml={out / 'serving.xml'}"]
    steps.append(Step("serving", serving))
    return steps


def junit_of(step: Step) -> Optional[Path]:
    """The JUnit XML file a pytest step writes, if it is one."""
    for arg in step.command:
        if arg.startswith("--junitxml="):
            return Path(arg.split("=", 1)[1])
    return None


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
        f"{report['started']}, {'smoke sizes' if report['smoke'] else 'device sizes'}, {report['seconds']} s: "
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


def train_config(recipe: str, device: str, steps: int, work: Path):
    """``recipe`` (a path, or "smoke") for ``steps`` training steps on ``device`` with the torch
    sparse backend, no validation, no progress bar; ML-1M reads synthetic ratings of its shape."""
    from gr.train.config import TrainConfig, apply_override, load_config, parse_value

    overrides = [
        ("trainer.accelerator", device),
        ("trainer.max_epochs", "1"),
        ("trainer.limit_train_batches", str(steps)),
        ("trainer.check_val_every_n_epoch", "2"),
        ("trainer.enable_progress_bar", "false"),
        ("trainer.memory_check", "false"),
        ("sparse.backend", "torch"),
    ]
    if recipe == "smoke":
        values = copy.deepcopy(SMOKE_RECIPE)
        for dotted, text in overrides:
            apply_override(values, dotted, parse_value(text))
        return TrainConfig.from_dict(values)
    if Path(recipe).name == Path(ML1M).name:
        from bench_data import write_ml1m_shaped_ratings

        (work / "ml-1m").mkdir(parents=True, exist_ok=True)
        write_ml1m_shaped_ratings(work / "ml-1m")
        overrides.append(("data.path", str(work / "ml-1m")))
    return load_config(ROOT / recipe, overrides)


def train_step(recipe: str, device: str, steps: int) -> Dict[str, Any]:
    """Time ``steps`` + 1 training steps of ``recipe`` on ``device`` (the first apart: compile and
    autotuning) -> first_step_s, step_ms, tokens_per_s, samples_per_s, hstu_gflops (the HSTU
    stack's useful FLOPs: 3x its forward's, no padding) and its fraction of the matmul peak
    measured here first (bf16 on a device, fp32 on CPU)."""
    import torch
    from _peak import matmul_peak
    from lightning.pytorch import Callback

    from gr.data.datamodule import SequenceDataModule
    from gr.train.memory import hstu_forward_flops_per_token
    from gr.train.module import GRTrainingModule
    from gr.train.run import make_trainer

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    class StepClock(Callback):
        def __init__(self) -> None:
            self.steps: List[Dict[str, float]] = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx: int) -> None:
            sync()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx: int) -> None:
            sync()
            lengths = (batch.seq_offsets[1:] - batch.seq_offsets[:-1]).tolist()
            flops = 3 * sum(n * hstu_forward_flops_per_token(config.model.hstu, n) for n in lengths)
            self.steps.append(dict(s=time.perf_counter() - self.start, tokens=sum(lengths), seqs=len(lengths), f=flops))

    # the device's bf16 matmul peak (fp32 on CPU, where this torch build's bf16 matmul is no reference)
    peak_dtype = torch.float32 if device == "cpu" else torch.bfloat16
    peak = matmul_peak(peak_dtype, 1.0, 512 if device == "cpu" else 8192, device)
    work = Path(tempfile.mkdtemp(prefix="gr-device-train-"))
    config = train_config(recipe, device, steps + 1, work)
    data = SequenceDataModule(config.data)
    data.setup()
    module = GRTrainingModule(config, data.feature_spec(), data.tasks, data.popularity())
    trainer, _ = make_trainer(config, work / "run")
    clock = StepClock()
    trainer.callbacks.append(clock)
    trainer.fit(module, datamodule=data)
    first, rest = clock.steps[0], clock.steps[1:]
    seconds = sum(s["s"] for s in rest)
    gflops = sum(s["f"] for s in rest) / seconds / 1e9
    return dict(
        bench="train_step",
        recipe=recipe,
        device=device,
        precision=config.trainer.precision,
        sparse_backend=config.sparse.backend,
        steps=len(rest),
        first_step_s=round(first["s"], 2),
        step_ms=round(1e3 * seconds / len(rest), 2),
        tokens_per_s=round(sum(s["tokens"] for s in rest) / seconds, 1),
        samples_per_s=round(sum(s["seqs"] for s in rest) / seconds, 1),
        hstu_gflops=round(gflops, 2),
        matmul_peak_gflops=round(peak, 1),
        peak_dtype=str(peak_dtype).removeprefix("torch."),
        hstu_fraction_of_peak=round(gflops / peak, 4),
    )


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", required=True, choices=DEVICES)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and a few conformance cases (seconds on CPU)")
    parser.add_argument("--out", type=Path, help="report directory (default: runs/device-check-DEVICE-TIME)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per step at most")
    parser.add_argument(
        "--budget", type=float, default=480.0, help="seconds for the whole check: a step gets what is left at most"
    )
    parser.add_argument(
        "--only", metavar="STEP[,STEP]", help="run these steps alone (e.g. serving, to rerun one that failed)"
    )
    parser.add_argument("--train-step", metavar="RECIPE", help="only time this recipe's training step (JSON line)")
    parser.add_argument("--steps", type=int, default=10, help="--train-step: steps timed after the first")
    args = parser.parse_args(argv)
    configure_backend_autoload(args.device)  # before torch: torch_npu loads only for npu
    if args.train_step:
        sys.path.insert(0, str(ROOT / "bench"))
        print(json.dumps(train_step(args.train_step, args.device, args.steps)))
        return 0
    started, start = time.strftime("%Y-%m-%d %H:%M:%S"), time.perf_counter()
    out = args.out or ROOT / "runs" / f"device-check-{args.device}-{time.strftime('%Y%m%d-%H%M%S')}"
    (out / "logs").mkdir(parents=True, exist_ok=True)

    steps = plan(args.device, args.smoke, out)
    if args.only:
        names = args.only.split(",")
        unknown = [n for n in names if n not in {s.name for s in steps}]
        if unknown:
            parser.error(f"--only: no step(s) {unknown}; this check's steps are {[s.name for s in steps]}")
        steps = [s for s in steps if s.name in names]
    try:
        require_device(args.device, "--device")
        error, name = None, device_name(args.device)
    except RuntimeError as err:
        error, name = str(err), "unavailable"
    env = {
        **os.environ,
        **autoload_env(args.device),
        "GR_TEST_DEVICE": args.device,
        "TRITON_CACHE_DIR": str(out / "cache" / "triton"),
        "GR_TRITON_CACHE_DIR": str(out / "cache" / "tuning"),
    }
    for step in steps:
        left = args.budget - (time.perf_counter() - start)
        if error is not None:
            step.note = "device unusable"
        elif left < 1:
            step.note = f"not run: the check's {args.budget:.0f} s (--budget) were spent"
        else:
            run_step(step, env, out / "logs", min(args.timeout, left), junit_of(step))
        print(f"{step.name:<17} {step.status:<8} {step.seconds:>8.1f} s  {last_line(step.note)}", flush=True)

    ok = error is None and all(step.status == "passed" for step in steps)
    report = {
        "device": args.device,
        "device_name": name,
        "device_error": error,
        "smoke": args.smoke,
        "ok": ok,
        "started": started,
        "seconds": round(time.perf_counter() - start, 1),
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
                "seconds": report["seconds"],
                "report": str(out / "report.json"),
                "steps": {step.name: step.status for step in steps},
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
