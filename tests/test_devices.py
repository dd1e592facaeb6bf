"""Device selection without the device: trainer.accelerator npu accepted with host tables and
refused otherwise, a clear error naming torch_npu / CANN when they are missing, the Lightning
accelerator registered under "npu", and the torch_npu autoload switched off unless an NPU is
requested or present. Nothing here ran on an NPU."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.accelerators import AcceleratorRegistry

from gr.utils import devices
from helpers.runs import BASE, config


def test_npu_accelerator_is_accepted_with_tables_in_host_memory():
    cfg = config(BASE, ("trainer.accelerator", "npu"), ("sparse.placement", "host"))
    assert cfg.trainer.accelerator == "npu"


def test_npu_accelerator_with_tables_on_the_device_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"sparse.placement: trainer.accelerator 'npu' needs 'host'.*'device'"):
        config(BASE, ("trainer.accelerator", "npu"))


def test_unknown_accelerator_lists_npu_among_the_choices():
    with pytest.raises(ValueError, match=r"trainer.accelerator.*'npu'"):
        config(BASE, ("trainer.accelerator", "tpu"))


def test_npu_trainer_without_torch_npu_names_the_missing_package(tmp_path: Path, monkeypatch):
    from gr.train.run import make_trainer

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_npu" else object())
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    cfg = config(BASE, ("trainer.accelerator", "npu"), ("sparse.placement", "host"))
    with pytest.raises(RuntimeError, match=r"trainer.accelerator: 'npu' needs the torch_npu package.* and CANN"):
        make_trainer(cfg, tmp_path)


def test_missing_cann_alone_is_named(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    with pytest.raises(RuntimeError, match=r"^x: 'npu' needs CANN \(ASCEND_HOME_PATH"):
        devices.load_torch_npu("x")


def test_npu_accelerator_registers_under_npu_and_is_unavailable_without_torch_npu():
    from gr.train.npu import NPUAccelerator

    registry = type(AcceleratorRegistry)()
    NPUAccelerator.register_accelerators(registry)
    assert registry["npu"]["accelerator"] is NPUAccelerator
    assert not NPUAccelerator.is_available()
    assert NPUAccelerator.auto_device_count() == 0
    assert NPUAccelerator.parse_devices(2) == [0, 1] and NPUAccelerator.parse_devices([3]) == [3]


@pytest.mark.parametrize(
    "requested, present, expected",
    [(None, False, "0"), ("cpu", True, "0"), ("npu", False, None), (None, True, None), ("auto", True, None)],
)
def test_backend_autoload_is_off_unless_an_npu_is_requested_or_present(monkeypatch, requested, present, expected):
    monkeypatch.setattr(devices, "npu_present", lambda environ=None: present)
    environ = {}
    devices.configure_backend_autoload(requested, environ)
    assert environ.get(devices.AUTOLOAD_VAR) == expected


def test_npu_presence_needs_torch_npu_and_device_nodes_or_cann(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert not devices.npu_present({"ASCEND_HOME_PATH": "/usr/local/Ascend"})
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(devices.glob, "glob", lambda pattern: [])
    assert devices.npu_present({"ASCEND_HOME_PATH": "/usr/local/Ascend"})
    assert not devices.npu_present({})


def test_npu_recipe_fits_the_recsdk_op_and_asks_for_the_npu():
    import torch

    from gr.hstu.kernels.attention import AttentionCall
    from gr.hstu.kernels.attention.ascend import mxrec_misfits
    from gr.train.config import load_config

    config = load_config("configs/ml1m_hstu_npu.yaml")
    hstu = config.model.hstu
    assert (config.trainer.accelerator, config.sparse.placement) == ("npu", "host")
    q = torch.zeros(3, hstu.num_heads, hstu.attention_dim, requires_grad=True)
    v = torch.zeros(3, hstu.num_heads, hstu.linear_dim, requires_grad=True)

    def op(
        q,
        k,
        v,
        mask,
        attn_bias,
        mask_type,
        max_seq_len,
        silu_scale,
        seq_offset,
        num_context,
        num_target,
        target_group_size,
        alpha,
    ):
        raise AssertionError("only its signature is read")

    call = AttentionCall(q, q, v, torch.tensor([0, 3]), hstu.max_seq_len, **hstu.attention_options().keywords())
    misfits = mxrec_misfits(op, call)
    assert misfits == []


def test_gr_test_device_selects_the_suite_device_and_refuses_others():
    assert devices.requested_test_device({}) is None
    assert devices.requested_test_device({"GR_TEST_DEVICE": "cpu"}) == "cpu"
    with pytest.raises(ValueError, match=r"GR_TEST_DEVICE: expected one of \['cpu', 'cuda', 'npu'\], got 'gpu'"):
        devices.requested_test_device({"GR_TEST_DEVICE": "gpu"})


def test_suite_device_is_the_requested_one_or_the_detected_one():
    assert devices.suite_device({"GR_TEST_DEVICE": "cpu"}) == "cpu"
    assert devices.suite_device({}) == devices.detected_device()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this host has a GPU")
def test_a_requested_suite_device_that_is_absent_is_refused_up_front():
    with pytest.raises(RuntimeError, match=r"^GR_TEST_DEVICE: 'cuda' needs a CUDA build of torch and a visible GPU"):
        devices.suite_device({"GR_TEST_DEVICE": "cuda"})


def test_an_autoload_setting_already_in_the_environment_is_kept(monkeypatch):
    monkeypatch.setattr(devices, "npu_present", lambda environ=None: False)
    assert devices.autoload_env("cpu", {devices.AUTOLOAD_VAR: "1"}) == {devices.AUTOLOAD_VAR: "1"}
    assert devices.autoload_env(None, {}) == {devices.AUTOLOAD_VAR: "0"}


@pytest.mark.skipif(
    devices.requested_test_device() not in (None, "cpu") or not importlib.util.find_spec("triton"),
    reason="the interpreter is the CPU suite's concern",
)
def test_interpreted_triton_kernels_pass_after_the_training_stack_is_collected_first():
    """The training stack imports triton (through torch) at collection; TRITON_INTERPRET must
    already be set then, so tests/conftest.py sets it, not the attention modules."""
    root = Path(__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items() if key not in ("TRITON_INTERPRET", "GR_TEST_DEVICE")}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:warnings",
        "tests/test_train_config.py::test_config_file_errors_name_the_file",
        "tests/test_attention_conformance.py::test_backend_matches_reference_forward_and_gradients"
        "[triton-targets,context,next-event-time]",
    ]
    run = subprocess.run(
        command, cwd=root, env={**env, "GR_TEST_DEVICE": "cpu"}, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert "2 passed" in run.stdout


def test_onednn_cache_is_raised_unless_the_environment_sets_it():
    environ = {}
    devices.configure_onednn_cache(environ)
    assert int(environ[devices.ONEDNN_CACHE_VAR]) >= 4096  # an ML-1M epoch's ~1,350 bf16 matmul shapes fit
    environ = {devices.ONEDNN_CACHE_VAR: "64"}
    devices.configure_onednn_cache(environ)
    assert environ[devices.ONEDNN_CACHE_VAR] == "64"


def test_the_gr_command_raises_the_onednn_cache_before_running(monkeypatch, capsys):
    from gr.commands import cli

    monkeypatch.setenv(devices.ONEDNN_CACHE_VAR, "0")  # undone after the test, so what main sets goes too
    monkeypatch.delenv(devices.ONEDNN_CACHE_VAR)
    cli.main(["--help"])
    assert os.environ[devices.ONEDNN_CACHE_VAR] == devices.ONEDNN_CACHE_CAPACITY
