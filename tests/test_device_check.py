"""bench/device_check.py: a step's result from its exit status and summary line, and the whole
check at smoke size on CPU writing report.json / report.md and one JSON line."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("device_check", ROOT / "bench" / "device_check.py")
device_check = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # bench/ is not a package
_spec.loader.exec_module(device_check)


def python_step(name, code):
    return device_check.Step(name, [sys.executable, "-c", code])


def test_a_step_that_ends_with_a_json_line_passes_with_that_summary(tmp_path):
    step = device_check.run_step(python_step("ok", "print('table'); print('{\"x\": 1}')"), os.environ, tmp_path, 60)
    assert (step.status, step.summary, step.note) == ("passed", {"x": 1}, "")
    assert Path(step.log).read_text() == 'table\n{"x": 1}\n'


def test_a_failing_step_is_failed_with_its_error_and_one_without_a_summary_too(tmp_path):
    step = device_check.run_step(
        python_step("boom", "raise SystemExit('no kernel for this device')"), os.environ, tmp_path, 60
    )
    assert step.status == "failed"
    assert step.note.startswith("exit status 1") and device_check.last_line(step.note) == "no kernel for this device"
    silent = device_check.run_step(python_step("silent", "print('done')"), os.environ, tmp_path, 60)
    assert silent.status == "failed" and "no JSON summary line" in silent.note


def test_a_step_past_its_time_limit_is_a_timeout(tmp_path):
    step = device_check.run_step(
        python_step("slow", "import time; print('start', flush=True); time.sleep(30)"), os.environ, tmp_path, 1
    )
    assert step.status == "timeout" and "start" in step.note


def test_the_device_plan_runs_conformance_without_autotuning_two_shapes_three_trainings_and_serving(tmp_path):
    steps = {s.name: s for s in device_check.plan("cuda", smoke=False, out=tmp_path)}
    assert list(steps) == [
        "conformance",
        "attention_ml1m",
        "attention_long",
        "train_ml1m",
        "train_ml1m_again",
        "train_long",
        "serving",
    ]
    assert "-k" not in steps["conformance"].command and steps["conformance"].env == {"GR_TRITON_AUTOTUNE": "0"}
    for shape in ("ml1m", "long"):
        command = steps[f"attention_{shape}"].command
        assert command[2:6] == ["--device", "cuda", "--backend", "triton"]
        assert command[command.index("--dtype") + 1] == "bf16" and command[command.index("--shape") + 1] == shape
    assert steps["train_ml1m"].command[2:6] == ["--train-step", "configs/ml1m_hstu.yaml", "--device", "cuda"]
    assert steps["train_long"].command[3] == "configs/generation_long.yaml"
    assert device_check.junit_of(steps["serving"]) == tmp_path / "serving.xml"
    npu = device_check.plan("npu", smoke=True, out=tmp_path)
    assert [s.name for s in npu] == ["conformance", "attention", "train", "serving"]
    assert npu[1].command[2:6] == ["--device", "npu", "--backend", "ascend"] and "-k" in npu[0].command


def test_steps_past_the_time_budget_are_not_run_and_the_check_fails(tmp_path, capsys):
    assert device_check.main(["--device", "cpu", "--smoke", "--out", str(tmp_path), "--budget", "0"]) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert not report["ok"] and [s["status"] for s in report["steps"]] == ["skipped"] * 4
    assert all("--budget" in s["note"] and s["log"] is None for s in report["steps"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ok"] is False


ONLY = "conformance,train"  # attention is bench/attention.py --smoke, which tests/test_benches.py runs


@pytest.mark.skipif(os.environ.get("GR_TEST_DEVICE", "cpu") != "cpu", reason="the smoke check here is the CPU one")
def test_smoke_check_on_cpu_writes_the_report_and_one_json_line(tmp_path, warm_python):
    out = tmp_path / "check"
    env = {k: v for k, v in os.environ.items() if k != "GR_TEST_DEVICE"}
    # serving is tests/test_device_end_to_end.py, which this suite runs itself
    argv = ["bench/device_check.py", "--device", "cpu", "--smoke", "--out", str(out), "--only", ONLY]
    run = warm_python.run(argv, cwd=ROOT, env=env, timeout=600)  # a process of its own (helpers.warm)
    last = json.loads(run.stdout.strip().splitlines()[-1])
    report = json.loads((out / "report.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert last == {
        "bench": "device_check",
        "device": "cpu",
        "device_name": report["device_name"],
        "ok": report["ok"],
        "seconds": report["seconds"],
        "report": str(out / "report.json"),
        "steps": {name: s["status"] for name, s in steps.items()},
    }
    assert run.returncode == (0 if report["ok"] else 1)
    assert report["device_error"] is None and report["smoke"] is True
    assert {"torch", "onnxruntime", "lightning"} <= set(report["packages"])
    conformance = steps["conformance"]
    assert conformance["status"] == "passed", conformance["note"]
    assert conformance["summary"]["tests"] > 0 and conformance["summary"]["failures"] == 0
    train = steps["train"]
    assert train["status"] == "passed", train["note"]
    assert train["summary"]["sparse_backend"] == "torch" and train["summary"]["steps"] == 2
    assert train["summary"]["tokens_per_s"] > 0 and train["summary"]["first_step_s"] > 0
    assert list(steps) == ONLY.split(",")  # --only: the other steps are left out
    assert run.returncode == 0 and report["ok"]
    markdown = (out / "report.md").read_text()
    assert markdown.startswith(f"# Device check: cpu ({report['device_name']})")
    for name, step in steps.items():
        assert f"| {name} | {step['status']} |" in markdown


def test_only_names_an_unknown_step_and_lists_the_check_s_steps(tmp_path):
    run = subprocess.run(
        [sys.executable, "bench/device_check.py", "--device", "cpu", "--smoke", "--out", str(tmp_path), "--only", "x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    steps = "['conformance', 'attention', 'train', 'serving']"
    assert f"--only: no step(s) ['x']; this check's steps are {steps}" in run.stderr
