"""Autotuning once: the on-disk cache of tile configurations (hit, miss, corrupt entry,
concurrent writers), the default table used when autotuning is off, and the CUDA layout's
choice between them (the device faked: nothing here runs on a GPU)."""

import json
import multiprocessing
import warnings
from pathlib import Path

import pytest
import torch

from gr.hstu.kernels.attention.triton import tuning
from gr.hstu.kernels.attention.triton.tuning import TileConfig, TuningCache, TuningKey

pytestmark = pytest.mark.attention

KEY = TuningKey(
    gpu="NVIDIA H100 80GB HBM3",
    triton="3.6.0",
    kernel="forward",
    max_len=256,
    dim_qk=64,
    dim_v=64,
    dtype="bfloat16",
)
CANDIDATES = [TileConfig(128, 64, 8, 2), TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 3)]


def timings(ms_by_config):
    """A ``time_ms`` that records what it timed."""
    timed = []

    def time_ms(config):
        timed.append(config)
        return ms_by_config[config]

    return time_ms, timed


def test_a_miss_times_every_candidate_and_stores_the_fastest(tmp_path):
    cache = TuningCache(tmp_path)
    assert cache.get(KEY) is None
    time_ms, timed = timings({CANDIDATES[0]: 0.9, CANDIDATES[1]: 0.4, CANDIDATES[2]: 0.7})
    assert tuning.tune(KEY, CANDIDATES, time_ms, cache) == CANDIDATES[1]
    assert timed == CANDIDATES
    entry = json.loads(cache.path(KEY).read_text())
    assert entry["config"] == {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}
    assert entry["timings_ms"] == {"128x64/w8/s2": 0.9, "64x64/w4/s2": 0.4, "64x32/w4/s3": 0.7}


def test_a_hit_in_another_cache_instance_times_nothing(tmp_path):
    TuningCache(tmp_path).put(KEY, CANDIDATES[2], {})
    time_ms, timed = timings({})
    assert tuning.tune(KEY, CANDIDATES, time_ms, TuningCache(tmp_path)) == CANDIDATES[2]
    assert timed == []


def test_each_part_of_the_key_names_its_own_entry(tmp_path):
    cache = TuningCache(tmp_path)
    cache.put(KEY, CANDIDATES[0], {})
    for change in (
        dict(gpu="NVIDIA A100-SXM4-80GB"),
        dict(triton="3.9.0"),
        dict(kernel="backward_dkv"),
        dict(max_len=512),
        dict(dim_qk=128),
        dict(dim_v=32),
        dict(dtype="float32"),
    ):
        other = TuningKey(**{**KEY.__dict__, **change})
        assert cache.get(other) is None, change
    assert cache.get(KEY) == CANDIDATES[0]


def test_a_config_label_parses_back_and_a_bad_one_is_named():
    for config in CANDIDATES:
        assert tuning.parse_config(config.label()) == config
    with pytest.raises(ValueError, match="MxN/wW/sS.*'64x32'"):
        tuning.parse_config("64x32")


def test_the_length_key_is_the_max_length_rounded_up_to_a_power_of_two():
    assert [tuning.length_bucket(n) for n in (1, 16, 17, 200, 256, 257, 4000)] == [16, 16, 32, 256, 256, 512, 4096]


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"format": 1, "key": {}, "config": {"block_m": 64}}),  # another key
        "",
    ],
    ids=["garbage", "other-key", "empty"],
)
def test_a_corrupt_entry_is_ignored_with_a_warning_and_retuned(tmp_path, content):
    cache = TuningCache(tmp_path)
    cache.path(KEY).write_text(content)
    with pytest.warns(UserWarning, match=f"{cache.path(KEY).name}.*ignored"):
        assert cache.get(KEY) is None
    time_ms, timed = timings({c: float(i) for i, c in enumerate(CANDIDATES)})
    with pytest.warns(UserWarning):
        assert tuning.tune(KEY, CANDIDATES, time_ms, cache) == CANDIDATES[0]
    assert timed == CANDIDATES
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.get(KEY) == CANDIDATES[0]


def test_an_entry_with_an_invalid_config_is_ignored(tmp_path):
    cache = TuningCache(tmp_path)
    cache.put(KEY, CANDIDATES[0], {})
    entry = json.loads(cache.path(KEY).read_text())
    entry["config"]["num_warps"] = 0
    cache.path(KEY).write_text(json.dumps(entry))
    with pytest.warns(UserWarning, match="invalid autotuning entry"):
        assert cache.get(KEY) is None


def test_a_candidate_that_fails_is_skipped_and_none_running_is_an_error(tmp_path):
    def time_ms(config):
        if config.block_m == 128:
            raise RuntimeError("out of shared memory")
        return config.block_n

    assert tuning.tune(KEY, CANDIDATES, time_ms, TuningCache(tmp_path)) == CANDIDATES[2]

    def never(config):
        raise RuntimeError("no device")

    with pytest.raises(RuntimeError, match="autotuning forward: no candidate ran"):
        tuning.tune(TuningKey(**{**KEY.__dict__, "max_len": 32}), CANDIDATES, never, TuningCache(tmp_path))


def _hammer(directory, index, rounds, results):
    """Write the key's entry (each process its own config) and read it back, ``rounds`` times."""
    cache = TuningCache(directory)
    mine = TileConfig(16 * (index + 1), 64, 4, 2)
    seen = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a torn or partial entry would warn: fail instead
        for _ in range(rounds):
            cache.put(KEY, mine, {"x": float(index)})
            config = cache.get(KEY)
            seen.add((config.block_m, config.block_n))
    results.put(sorted(seen))


def test_concurrent_writers_of_one_key_never_leave_a_torn_entry(tmp_path):
    # spawn, not fork: a fork of a suite worker that runs other threads (torch's, a server's) can
    # inherit a lock one of them held and hang
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    workers = [context.Process(target=_hammer, args=(tmp_path, i, 60, results)) for i in range(3)]
    for worker in workers:
        worker.start()
    seen = [results.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    assert [worker.exitcode for worker in workers] == [0, 0, 0]
    written = {(16 * (i + 1), 64) for i in range(3)}
    assert all(set(map(tuple, s)) <= written for s in seen)
    assert (TuningCache(tmp_path).get(KEY).block_m, 64) in written
    assert sorted(p.name for p in tmp_path.iterdir()) == [KEY.filename()]  # no temporary file left


def test_autotuning_is_on_unless_the_environment_turns_it_off(monkeypatch):
    monkeypatch.delenv(tuning.ENV_AUTOTUNE, raising=False)
    assert tuning.autotune_enabled()
    for off in ("0", "false", "OFF"):
        monkeypatch.setenv(tuning.ENV_AUTOTUNE, off)
        assert not tuning.autotune_enabled()
    monkeypatch.setenv(tuning.ENV_AUTOTUNE, "1")
    assert tuning.autotune_enabled()


def test_the_default_is_the_first_candidate_of_every_kernel_architecture_dtype_and_width():
    for major, family in ((7, 8), (8, 8), (9, 9), (10, 9), (12, 9)):
        assert tuning.arch_family(major) == family
        for kernel in tuning.KERNELS:
            for dtype, dims, column in (
                ("float32", (50, 50), "fp32/d64"),
                ("float32", (64, 128), "fp32/d128"),
                ("bfloat16", (25, 64), "16bit/d64"),
                ("float16", (128, 128), "16bit/d128"),
            ):
                configs = tuning.candidates(major, kernel, dtype, *dims)
                assert configs == tuning.CANDIDATES[family][column][kernel] and len(set(configs)) == len(configs)
                assert tuning.default_config(major, kernel, dtype, *dims) == configs[0]
                assert all(c.block_m % 16 == 0 and c.block_n % 16 == 0 for c in configs)


@pytest.fixture
def fake_h100(monkeypatch, tmp_path):
    """The CUDA layout's view of an H100 (its name and capability), a cache in tmp_path, and a
    benchmark that counts its calls (the launch itself is not run)."""
    pytest.importorskip("triton")
    from gr.hstu.kernels.attention.triton import cuda as triton_attention

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setenv(tuning.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(triton_attention, "_CHOSEN", {})
    benchmarked = []

    def do_bench(fn, warmup, rep):
        benchmarked.append(fn)
        return 1.0 / len(benchmarked)  # the last candidate is the fastest

    monkeypatch.setattr(triton_attention.triton.testing, "do_bench", do_bench)
    return triton_attention, benchmarked


def _forward_launch():
    from gr.hstu.kernels.attention.common import AttentionCall
    from gr.hstu.kernels.attention.triton.host import forward_launch, prepare_inputs

    q = torch.zeros(10, 1, 32)
    inputs = prepare_inputs(AttentionCall(q, q, q, torch.tensor([0, 4, 10]), 6, silu_scale=0.1), "triton")
    return forward_launch(q, q, q, inputs, interpreted=True), inputs


def test_cuda_layout_takes_the_table_when_autotuning_is_off(fake_h100, monkeypatch):
    triton_attention, benchmarked = fake_h100
    monkeypatch.setenv(tuning.ENV_AUTOTUNE, "0")
    launch, inputs = _forward_launch()
    config = triton_attention.CudaLayout(None).config(launch, inputs, run=lambda c: None)
    assert config == tuning.CANDIDATES[9]["fp32/d64"]["forward"][0] and benchmarked == []


def test_cuda_layout_autotunes_once_and_a_new_process_reads_the_result(fake_h100, monkeypatch, tmp_path):
    triton_attention, benchmarked = fake_h100
    monkeypatch.setenv(tuning.ENV_AUTOTUNE, "1")
    launch, inputs = _forward_launch()
    layout = triton_attention.CudaLayout(None)
    candidates = tuning.CANDIDATES[9]["fp32/d64"]["forward"]
    assert layout.config(launch, inputs, run=lambda c: None) == candidates[-1]
    assert len(benchmarked) == len(candidates)
    assert layout.config(launch, inputs, run=lambda c: None) == candidates[-1]  # in-process memo
    monkeypatch.setattr(triton_attention, "_CHOSEN", {})  # a new process: the disk entry
    assert layout.config(launch, inputs, run=lambda c: None) == candidates[-1]
    assert len(benchmarked) == len(candidates)
    (entry,) = tmp_path.iterdir()
    assert "forward-L16-qk32-v32-float32" in entry.name and "H100" in entry.name


def _unwritable(kind, tmp_path):
    """A cache directory that cannot store an entry of KEY, of the given kind."""
    if kind == "read-only file system":
        return Path("/proc/gr-triton-tuning")  # cannot be created, even by root
    if kind == "directory is a file":
        (tmp_path / "cache").write_text("")
    else:
        (tmp_path / "cache" / KEY.filename()).mkdir(parents=True)
    return tmp_path / "cache"


@pytest.mark.parametrize("kind", ["directory is a file", "entry is a directory", "read-only file system"])
def test_an_unwritable_cache_warns_once_and_tuning_goes_on(kind, tmp_path):
    cache = TuningCache(_unwritable(kind, tmp_path))
    other = TuningKey(**{**KEY.__dict__, "kernel": "dq"})
    time_ms, timed = timings({CANDIDATES[0]: 3.0, CANDIDATES[1]: 1.0, CANDIDATES[2]: 2.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: each distinct warning once per place
        for key in (KEY, other, KEY):
            assert tuning.tune(key, CANDIDATES, time_ms, cache) == CANDIDATES[1]
    stored = [str(w.message) for w in caught if "cannot store autotuning results" in str(w.message)]
    assert len(stored) == 1 and str(cache.directory) in stored[0] and tuning.ENV_CACHE_DIR in stored[0]
    assert len(timed) == 3 * len(CANDIDATES)  # nothing stored: each call tuned again, none raised


def test_the_cuda_layout_keeps_tiles_tuned_under_an_unwritable_cache_for_the_process(fake_h100, monkeypatch, tmp_path):
    triton_attention, benchmarked = fake_h100
    monkeypatch.setenv(tuning.ENV_AUTOTUNE, "1")
    monkeypatch.setenv(tuning.ENV_CACHE_DIR, str(_unwritable("directory is a file", tmp_path)))
    launch, inputs = _forward_launch()
    layout = triton_attention.CudaLayout(None)
    candidates = tuning.CANDIDATES[9]["fp32/d64"]["forward"]
    with pytest.warns(UserWarning, match="cannot store autotuning results"):
        assert layout.config(launch, inputs, run=lambda c: None) == candidates[-1]
    assert layout.config(launch, inputs, run=lambda c: None) == candidates[-1]
    assert len(benchmarked) == len(candidates)  # the second launch reused the tiles in memory
