import os

from gr.devices import configure_backend_autoload, requested_test_device, suite_device

# GR_TEST_DEVICE=npu keeps torch_npu's autoload on; unset or cpu/cuda, it stays off unless an NPU host is detected
configure_backend_autoload(requested_test_device())
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if suite_device() == "cpu":
    # Triton's interpreter for the Triton kernels on CPU tensors: read when triton is first imported, and the
    # training stack imports it (through torch) before any attention test module, so it is set here, once.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def single_thread():
    """One torch thread for a module of many tiny ops (generation): on a loaded 2-core machine,
    intra-op threads make each small op wait for a busy core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def process_group(tmp_path):
    """A one-rank gloo process group for the test (DistributedModelParallel needs one), unless one exists."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


DISTRIBUTED_ENV = {
    name: os.environ.get(name)
    for name in (
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "NODE_RANK",
    )
}


@pytest.fixture(autouse=True)
def _distributed_env():
    """A run in this process (Lightning) sets MASTER_PORT & co. and keeps its store listening on that
    port; a later test's subprocess must not inherit them and try to listen there too. After each
    test they are back to what the session started with."""
    yield
    for name, value in DISTRIBUTED_ENV.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
