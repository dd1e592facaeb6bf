"""docs/hstu_slice.md is enough to serve the HSTU slice: tests/hstu_slice_numpy.py, written from the
doc alone in plain numpy, reproduces gr's loaded slice (``load_hstu``) and its cached serving path
on exports that switch each documented feature on and off, float32 and bfloat16."""

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hstu_slice_numpy import HSTUSlice, evicted_prefix, next_event_query_times, read_safetensors, time_bucket
from test_export_roundtrip import DENSE_DIMS, HSTU_KW, build_ranking_model

from gr.export import export_model, load_hstu
from gr.hstu.cache import CachedHSTU
from gr.hstu.kernels.attention.common import time_bucket as gr_time_bucket
from gr.jagged_rows import evicted_prefix as gr_evicted_prefix

TESTS = Path(__file__).parent
MAX_SEQ_LEN = HSTU_KW["max_seq_len"]
# (history, targets) per sequence: a full history (targets at position max_seq_len), one token,
# no targets, targets only, and a middle one
SEQUENCES = [(MAX_SEQ_LEN, 3), (1, 1), (7, 0), (0, 2), (13, 4)]
CASES = {
    "layers_heads_log_time": dict(num_layers=3, num_heads=3, attention_dim=4, linear_dim=6),
    "next_event_sqrt_contextual_window_seq_len": dict(
        query_time="next_event",
        time_bucketing="sqrt",
        time_buckets=64,
        contextual_len=3,
        max_attn_len=5,
        attn_norm="seq_len",
    ),
    "clamped_buckets_next_event_alpha": dict(
        position_buckets=6, time_buckets=8, attn_alpha=0.7, query_time="next_event"
    ),
    "no_scaling_no_positions_no_bias": dict(
        num_layers=1, scale_input=False, position_embedding=False, position_buckets=0, time_buckets=0
    ),
}
EXPORTS = [(case, "float32") for case in CASES] + [
    ("next_event_sqrt_contextual_window_seq_len", "bfloat16"),
    ("layers_heads_log_time", "bfloat16"),
]


@pytest.fixture(scope="module", params=EXPORTS, ids=[f"{case}-{dtype}" for case, dtype in EXPORTS])
def exported(request, tmp_path_factory):
    case, dtype = request.param
    model = build_ranking_model(**CASES[case])
    path = export_model(model, tmp_path_factory.mktemp(case) / "export", dense_dims=DENSE_DIMS, hstu_dtype=dtype)
    return path, dtype


def jagged_batch(seed: int = 0):
    """SEQUENCES as x [T, 16], timestamps [T] (sorted history gaps from 0 s to days; targets a few
    seconds apart after the request time), seq_offsets [B+1], num_targets [B], request_times [B]."""
    rng = np.random.default_rng(seed)
    ts, request_times = [], []
    for hist, targets in SEQUENCES:
        gaps = np.exp(rng.uniform(0.0, np.log(3e5), hist)).astype(np.int64) * (rng.random(hist) > 0.1)
        history = 1_700_000_000 + np.cumsum(gaps)
        request = int(history[-1] if hist else 1_700_000_000) + int(rng.integers(1, 5000))
        ts += [history, request + rng.integers(0, 30, targets)]
        request_times.append(request)
    lengths = np.array([h + t for h, t in SEQUENCES])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    x = rng.standard_normal((int(offsets[-1]), HSTU_KW["hidden_dim"])).astype(np.float32)
    num_targets = np.array([t for _, t in SEQUENCES], dtype=np.int64)
    return x, np.concatenate(ts).astype(np.int64), offsets, num_targets, np.array(request_times, dtype=np.int64)


def test_numpy_slice_from_the_doc_matches_load_hstu_on_a_jagged_batch(exported):
    path, dtype = exported
    x, ts, offsets, num_targets, request_times = jagged_batch()
    query_times = next_event_query_times(ts, offsets, num_targets, request_times)
    reference = HSTUSlice.load(path)
    assert reference.config["torch_dtype"] == dtype
    assert {np.dtype(np.float32)} == {w.dtype for w in read_safetensors(path / "hstu/model.safetensors").values()}
    got = reference.forward(x, ts, offsets, num_targets, query_times)
    with torch.no_grad():
        want = load_hstu(path)(
            torch.from_numpy(x),
            torch.from_numpy(offsets),
            int(np.diff(offsets).max()),
            torch.from_numpy(ts),
            torch.from_numpy(num_targets),
            torch.from_numpy(query_times),
        )
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


def test_cached_serving_with_a_request_time_matches_the_docs_query_times(exported):
    """gr's serving engine gets only the request time (its next_event history keeps the last token
    pending, section 5.1); its candidate outputs equal the doc's one-pass outputs."""
    path, _ = exported
    x, ts, offsets, num_targets, request_times = jagged_batch(seed=1)
    b = 4  # 13 history tokens, 4 targets
    rows = slice(int(offsets[b]), int(offsets[b + 1]))
    hist = int(offsets[b + 1] - offsets[b] - num_targets[b])
    xs, tss = torch.from_numpy(x[rows]), torch.from_numpy(ts[rows])
    engine = CachedHSTU(load_hstu(path))
    cache = engine.extend(engine.encode(xs[: hist - 3], tss[: hist - 3]), xs[hist - 3 : hist], tss[hist - 3 : hist])
    got = engine.score(cache, xs[hist:], tss[hist:], micro_batch=3, request_time=int(request_times[b]))
    one = np.array([0, rows.stop - rows.start])
    query_times = next_event_query_times(ts[rows], one, num_targets[b : b + 1], request_times[b : b + 1])
    want = HSTUSlice.load(path).forward(x[rows], ts[rows], one, num_targets[b : b + 1], query_times)[hist:]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bucketing", ["log", "sqrt"])
@pytest.mark.parametrize("num_buckets", [8, 128, 10**6])
def test_doc_time_buckets_equal_gr_buckets_for_every_delta_up_to_a_million_seconds(bucketing, num_buckets):
    dt = np.arange(-(2**20), 2**20 + 1, dtype=np.int64)
    want = gr_time_bucket(torch.from_numpy(dt), bucketing, num_buckets).numpy()
    got = time_bucket(dt, bucketing, num_buckets, 0.301)
    np.testing.assert_array_equal(got, want)
    assert want.max() == min(num_buckets - 1, int(np.sqrt(2**20)) if bucketing == "sqrt" else 46)


def test_doc_eviction_windows_equal_gr_windows():
    for block in (1, 7, MAX_SEQ_LEN):
        for length in range(0, 3 * MAX_SEQ_LEN):
            dropped = evicted_prefix(length, MAX_SEQ_LEN, block)
            assert dropped == gr_evicted_prefix(length, MAX_SEQ_LEN, block)
            assert length - dropped <= MAX_SEQ_LEN and dropped % block == 0


def test_reference_refuses_a_slice_file_changed_after_export(exported, tmp_path):
    path, _ = exported
    copy = shutil.copytree(path, tmp_path / "export")
    config = json.loads((copy / "hstu/config.json").read_text())
    (copy / "hstu/config.json").write_text(json.dumps({**config, "max_attn_len": 1}))
    with pytest.raises(ValueError, match="hstu/config.json: sha256 differs from MANIFEST"):
        HSTUSlice.load(copy)


def test_reference_imports_neither_gr_nor_torch(exported):
    path, _ = exported
    source = (TESTS / "hstu_slice_numpy.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "hashlib", "json", "math", "struct", "pathlib", "typing", "numpy"}, imported
    x, ts, offsets, num_targets, request_times = jagged_batch()
    np.savez(
        path.parent / "batch.npz",
        x=x,
        ts=ts,
        offsets=offsets,
        num_targets=num_targets,
        query_times=next_event_query_times(ts, offsets, num_targets, request_times),
    )
    script = (
        "import sys, numpy as np\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        "from hstu_slice_numpy import HSTUSlice\n"
        f"b = np.load({str(path.parent / 'batch.npz')!r})\n"
        f"ref = HSTUSlice.load({str(path)!r})\n"
        "out = ref.forward(b['x'], b['ts'], b['offsets'], b['num_targets'], b['query_times'])\n"
        "assert np.isfinite(out).all() and out.shape == b['x'].shape\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('gr', 'torch')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=path.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
