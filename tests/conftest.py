import importlib.util
import os

from gr.utils.devices import configure_backend_autoload, requested_test_device, suite_device

# GR_TEST_DEVICE=npu keeps torch_npu's autoload on; unset or cpu/cuda, it stays off unless an NPU host is detected
configure_backend_autoload(requested_test_device())
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
os.environ.setdefault("GR_TRITON_AUTOTUNE", "0")  # Triton tiles from the built-in table: no autotuning in tests
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # pytest-xdist's workers share the cores: each worker, and every process it starts, gets its share of
    # intra-op threads (read when torch is first imported; suite_device, below, imports it). With more threads
    # than free cores each small op waits, spinning, at OpenMP barriers for a descheduled thread: on the
    # 2-core development machine with the cores busy (load ~4) a module took up to 2.3 times the CPU time of
    # one thread, and longer.
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // workers)))
if suite_device() == "cpu":
    # Triton's interpreter for the Triton kernels on CPU tensors: read when triton is first imported, and the
    # training stack imports it (through torch) before any attention test module, so it is set here, once.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from gr.export import onnx_graph_cache  # noqa: E402
from helpers.movielens import ml_100k_missing, ml_100k_path  # noqa: E402
from helpers.warm import WarmPython, fresh_sys_path  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    from helpers.triton_interpreter import skip_repatching_in_launches  # noqa: E402

    skip_repatching_in_launches()

# End-to-end modules: training runs, subprocesses, servers, benchmarks. ``-m "not slow"`` leaves them out
# for a fast inner loop (docs/development.md); ``make test`` runs everything.
SLOW_MODULES = {
    "test_benches.py",
    "test_benches_training.py",
    "test_daily_retrain_bench.py",
    "test_list_features.py",
    "test_new_items.py",
    "test_new_users.py",
    "test_serving_operations.py",
    "test_warm_start.py",
    "test_cli_errors.py",
    "test_console.py",
    "test_custom_project.py",
    "test_device_check.py",
    "test_device_end_to_end.py",
    "test_devices.py",
    "test_declared_features.py",
    "test_evaluate.py",
    "test_export_roundtrip.py",
    "test_export_run.py",
    "test_faults.py",
    "test_fsdp.py",
    "test_generation_serving.py",
    "test_hstu_slice_spec.py",
    "test_item_store.py",
    "test_prepared_spark.py",
    "test_model_class.py",
    "test_serving_http.py",
    "test_serving_retrieval_batching.py",
    "test_train_progress.py",
    "test_train_run.py",
}


@pytest.fixture(scope="session", autouse=True)
def onnx_graph_cache_of_the_run(tmp_path_factory):
    """One ONNX graph cache for the run (both xdist workers and the processes they start) instead of
    the developer's ~/.cache/gr/onnx: the run's first export of an architecture translates it."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    os.environ.setdefault(onnx_graph_cache.CACHE_DIR_ENV, str(shared / "onnx-graphs"))


def pytest_collection_modifyitems(items):
    """Marks the end-to-end modules slow, and orders the modules: the slow ones first, then by their
    number of tests, most first (a module's tests keep their order). ``make test`` hands each worker
    the next module in this order (``--dist loadfile --no-loadscope-reorder``): the long modules start
    early, and the short ones left at the end even out when the two workers finish."""
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    counts = Counter(item.path for item in items)
    firsts = {}
    for index, item in enumerate(items):
        firsts.setdefault(item.path, index)
    items.sort(key=lambda item: (item.path.name not in SLOW_MODULES, -counts[item.path], firsts[item.path]))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def ml_100k() -> Path:
    """The real MovieLens-100K directory (``helpers.movielens.ml_100k_path``: ``$GR_ML100K_DIR``,
    else data/ml-100k); a test that takes it is skipped, with the download command, when it is absent."""
    reason = ml_100k_missing()
    if reason:
        pytest.skip(reason)
    return ml_100k_path()


@pytest.fixture(scope="session")
def warm_python() -> WarmPython:
    """Scripts run in children of a warm interpreter (``helpers.warm``), one fork server per worker."""
    return WarmPython(fresh_sys_path())


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
