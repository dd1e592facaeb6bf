"""The attention backends the device under test runs (shared by the conformance suites)."""

import importlib.util

from gr.utils.devices import suite_device

DEVICE = suite_device()  # GR_TEST_DEVICE, else detected (cpu: Triton's interpreter, set by tests/conftest.py)
HAS_TRITON = importlib.util.find_spec("triton") is not None
# The fast backends of DEVICE, each checked against the pytorch reference.
KERNEL_BACKENDS = [
    name
    for name, ok in [
        ("cpu", DEVICE == "cpu"),
        ("triton", HAS_TRITON and DEVICE in ("cpu", "cuda")),
        ("ascend_triton", HAS_TRITON and DEVICE in ("cpu", "npu")),
        ("ascend", DEVICE == "npu"),
    ]
    if ok
]
