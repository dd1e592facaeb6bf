"""Conformance: every HSTU attention backend available on this machine against the pytorch
reference (forward and the gradients of q, k, v and both bias weights), and the reference
against a naive per-sequence implementation written from the spec.

On a CPU-only host the Triton kernels (CUDA and triton-ascend variants) run in Triton's
interpreter; on a CUDA or NPU host the same tests run the compiled kernels on the device
(``GR_TEST_DEVICE=cuda``; fp32 there multiplies as three tf32 products, within the same tolerances).
Select with ``-m attention``.
"""

import math
import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from gr.hstu.kernels.attention import RelativeBias, hstu_attention
from gr.hstu.kernels.attention.ascend import find_mxrec_hstu_jagged
from gr.hstu.kernels.attention.triton.tuning import ENV_AUTOTUNE
from helpers.backends import DEVICE, KERNEL_BACKENDS

BACKENDS = KERNEL_BACKENDS + (["cpu-unfused"] if "cpu" in KERNEL_BACKENDS else [])
# On a device the kernels run at their architecture's default tiles (no autotuning: each bias
# combination compiles once per pass and dtype, shared by the cases that use it).
os.environ.setdefault(ENV_AUTOTUNE, "0")

pytestmark = pytest.mark.attention


def make_batch(
    lengths,
    targets,
    heads=1,
    dim_qk=16,
    dim_v=12,
    pos_buckets=0,
    time_buckets=0,
    bucketing="log",
    seed=0,
    query_times=False,
):
    """Random jagged batch on DEVICE; bias weights large enough that a wrong bucket shows.

    query_times: give each query its own time (a random later one, like the next event's)."""
    g = torch.Generator().manual_seed(seed)
    lengths_t = torch.tensor(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths_t.cumsum(0)])
    total = int(offsets[-1])
    q, k = (torch.randn(total, heads, dim_qk, generator=g) for _ in range(2))
    v = torch.randn(total, heads, dim_v, generator=g)
    ts = torch.cat([torch.sort(torch.randint(0, 10**7, (n,), generator=g)).values for n in lengths])
    pos_w = torch.randn(pos_buckets, generator=g) if pos_buckets else None
    time_w = torch.randn(time_buckets, generator=g) if time_buckets else None
    num_targets = torch.tensor(targets) if targets is not None else None
    query_ts = ts + torch.randint(0, 10**5, ts.shape, generator=g) if query_times else None
    tensors = dict(q=q, k=k, v=v, pos_w=pos_w, time_w=time_w)
    meta = dict(seq_offsets=offsets, num_targets=num_targets, timestamps=ts, bucketing=bucketing, query_times=query_ts)
    return {name: x.to(DEVICE) if x is not None else None for name, x in tensors.items()}, {
        name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in meta.items()
    }


def run(backend, tensors, meta, dtype=torch.float32, **options):
    """Output and gradients (q, k, v, pos_w, time_w; None where off) under a fixed cotangent.
    "cpu-unfused" is the cpu backend with its fused tiles off (its fallback where they cannot build)."""
    if backend == "cpu-unfused":
        with mock.patch.dict(os.environ, {"GR_CPU_FUSED": "0"}):
            return run("cpu", tensors, meta, dtype, **options)
    leaves = {name: x.to(dtype).detach().requires_grad_(True) if x is not None else None for name, x in tensors.items()}
    rab = None
    if leaves["pos_w"] is not None or leaves["time_w"] is not None:
        rab = RelativeBias(
            position_weights=leaves["pos_w"],
            time_weights=leaves["time_w"],
            timestamps=meta["timestamps"] if leaves["time_w"] is not None else None,
            time_bucketing=meta["bucketing"],
            query_times=meta.get("query_times") if leaves["time_w"] is not None else None,
        )
    max_len = int((meta["seq_offsets"][1:] - meta["seq_offsets"][:-1]).max())
    out = hstu_attention(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        meta["seq_offsets"],
        max_len,
        num_targets=meta["num_targets"],
        rab=rab,
        backend=backend,
        **options,
    )
    g = torch.Generator().manual_seed(1)
    cotangent = torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype)
    present = [x for x in leaves.values() if x is not None]
    grads = iter(torch.autograd.grad((out * cotangent).sum(), present))
    return out.detach(), {name: next(grads) if x is not None else None for name, x in leaves.items()}


def assert_matches(actual, expected, tol, what):
    actual, expected = actual.float(), expected.float()
    scale = float(expected.abs().max()) + 1e-6
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


SMALL = [1, 2, 37, 90, 5, 64, 3]
CASES = {
    "causal,pos+log-time,per-position-norm": dict(
        lengths=SMALL, targets=None, heads=2, pos_buckets=100, time_buckets=40, options=dict(alpha=0.3, silu_scale=None)
    ),
    "targets,pos+sqrt-time": dict(
        lengths=SMALL,
        targets=[1, 0, 4, 7, 0, 2, 3],
        heads=2,
        pos_buckets=50,
        time_buckets=64,
        bucketing="sqrt",
        options=dict(alpha=0.25, silu_scale=1 / 90),
    ),
    "targets,context,pos": dict(
        lengths=SMALL,
        targets=[0, 1, 3, 5, 2, 0, 1],
        pos_buckets=100,
        options=dict(alpha=0.25, silu_scale=None, contextual_len=3),
    ),
    "targets,context,window,time": dict(
        lengths=SMALL,
        targets=[1, 0, 2, 6, 1, 3, 0],
        time_buckets=40,
        options=dict(alpha=0.25, silu_scale=None, contextual_len=2, max_attn_len=9),
    ),
    "window,no-bias": dict(lengths=SMALL, targets=None, options=dict(alpha=0.25, silu_scale=1 / 64, max_attn_len=20)),
    "causal,pos+next-event-time": dict(
        lengths=SMALL,
        targets=None,
        heads=2,
        pos_buckets=100,
        time_buckets=40,
        query_times=True,
        options=dict(alpha=0.3, silu_scale=None),
    ),
    "targets,context,next-event-time": dict(
        lengths=SMALL,
        targets=[1, 0, 4, 7, 0, 2, 3],
        time_buckets=64,
        bucketing="sqrt",
        query_times=True,
        options=dict(alpha=0.25, silu_scale=1 / 90, contextual_len=2),
    ),
    "long-sequence,targets,pos+time": dict(
        lengths=[520, 1, 6],
        targets=[6, 0, 2],
        pos_buckets=600,
        time_buckets=64,
        options=dict(alpha=0.25, silu_scale=None),
    ),
}


def _case(name):
    spec = dict(CASES[name])
    options = spec.pop("options")
    tensors, meta = make_batch(**spec)
    return tensors, meta, options


def _vendor_refuses(backend, options):
    """RecSDK's op (backend 'ascend' when installed) cannot express these options."""
    if backend != "ascend" or find_mxrec_hstu_jagged() is None:
        return False
    return options.get("silu_scale") is None or options.get("contextual_len", 0) or options.get("max_attn_len", 0)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow if "long" in c else ()) for c in CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_reference_forward_and_gradients(backend, case):
    tensors, meta, options = _case(case)
    if _vendor_refuses(backend, options):
        with pytest.raises(ValueError, match="cannot express"):
            run(backend, tensors, meta, **options)
        return
    out, grads = run(backend, tensors, meta, **options)
    ref_out, ref_grads = run("pytorch", tensors, meta, **options)
    assert_matches(out, ref_out, 1e-4, "output")
    for name, ref in ref_grads.items():
        if ref is None:
            assert grads[name] is None
        else:
            assert_matches(grads[name], ref, 2e-4, f"d{name}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_reference_in_bf16(backend):
    """bf16 inputs against the fp32 reference on the same (rounded) values, loose tolerance."""
    tensors, meta, options = _case("targets,pos+sqrt-time")
    tensors = {name: x.to(torch.bfloat16).float() if x is not None else None for name, x in tensors.items()}
    out, grads = run(backend, tensors, meta, dtype=torch.bfloat16, **options)
    assert out.dtype == torch.bfloat16
    ref_out, ref_grads = run("pytorch", tensors, meta, **options)
    assert_matches(out, ref_out, 3e-2, "output")
    for name, ref in ref_grads.items():
        assert_matches(grads[name], ref, 5e-2, f"d{name}")


def bucket_edge_deltas(bucketing):
    """[69] time deltas on and next to each of the first 23 bucket boundaries, ascending."""
    edges = range(1, 24)
    if bucketing == "log":
        deltas = [int(math.exp(0.301 * b)) + d for b in edges for d in (-1, 0, 1)]
    else:
        deltas = [b * b + d for b in edges for d in (-1, 0, 1)]
    return [max(d, 0) for d in deltas]


def alternating_bucket_weights(num_buckets):
    """[num_buckets] fp32 of -1, 1, -1, ...: neighbouring buckets differ by 2, so an off-by-one shows."""
    return torch.arange(num_buckets, dtype=torch.float32, device=DEVICE) % 2 * 2.0 - 1.0


@pytest.mark.parametrize("bucketing", ["log", "sqrt"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_time_buckets_agree_with_reference_at_bucket_edges(backend, bucketing):
    """Time deltas on and next to every bucket boundary: an off-by-one bucket would show, since
    neighbouring bucket weights differ by ~1."""
    deltas = bucket_edge_deltas(bucketing)
    ts = torch.tensor([0] + deltas).cumsum(0).flip(0).neg()  # increasing, so every pair is a sum of deltas
    length = ts.numel()
    tensors, meta = make_batch([length], None, time_buckets=32, bucketing=bucketing)
    meta["timestamps"] = (ts - ts.min()).to(DEVICE)
    tensors["time_w"] = alternating_bucket_weights(32)
    options = dict(alpha=0.25, silu_scale=0.05)
    out, grads = run(backend, tensors, meta, **options)
    ref_out, ref_grads = run("pytorch", tensors, meta, **options)
    assert_matches(out, ref_out, 1e-4, "output")
    assert_matches(grads["time_w"], ref_grads["time_w"], 2e-4, "dtime_w")


@pytest.mark.parametrize("bucketing", ["log", "sqrt"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_query_time_buckets_agree_with_reference_at_bucket_edges(backend, bucketing):
    """Each token is queried a bucket-edge delta after or before its own time (tq_i - t_i = +-edge),
    so every token's bias on itself lands on or next to a bucket boundary: in the score tiles for
    the all-history sequence, in the target self terms for the same tokens as targets."""
    offsets = torch.tensor([0] + bucket_edge_deltas(bucketing))
    offsets[1::2] *= -1  # |tq - t| either way round
    n = offsets.numel()
    ts = torch.arange(n) * 1000
    tensors, meta = make_batch([n, n], [0, n - 1], time_buckets=32, bucketing=bucketing)
    meta["timestamps"] = torch.cat([ts, ts]).to(DEVICE)
    meta["query_times"] = torch.cat([ts + offsets, ts + offsets]).to(DEVICE)
    tensors["time_w"] = alternating_bucket_weights(32)
    options = dict(alpha=0.25, silu_scale=0.05)
    out, grads = run(backend, tensors, meta, **options)
    ref_out, ref_grads = run("pytorch", tensors, meta, **options)
    assert_matches(out, ref_out, 1e-4, "output")
    for name in ("q", "k", "v", "time_w"):
        assert_matches(grads[name], ref_grads[name], 2e-4, f"d{name}")


def naive_attention(
    q,
    k,
    v,
    lengths,
    targets,
    alpha,
    silu_scale,
    contextual_len,
    max_attn_len,
    pos_w,
    time_w,
    ts,
    bucketing,
    query_ts=None,
):
    """Sequence by sequence, pair by pair, from the spec (docs/design.md §6 / gr.hstu.kernels.attention.common)."""
    query_ts = ts if query_ts is None else query_ts
    outs, start = [], 0
    for b, n in enumerate(lengths):
        hist = n - (targets[b] if targets is not None else 0)
        mask = torch.zeros(n, n)
        bias = torch.zeros(n, n, dtype=torch.float64)
        for i in range(n):
            pi = min(i, hist)
            for j in range(n):
                pj = min(j, hist)
                if j == i:
                    seen = True
                elif j >= hist:
                    seen = False  # another target
                elif j < contextual_len:
                    seen = True
                else:
                    seen = 0 < pi - j and (max_attn_len == 0 or pi - j <= max_attn_len)
                mask[i, j] = float(seen)
                if pos_w is not None:
                    bias[i, j] += pos_w[min(max(pi - pj, 0), pos_w.numel() - 1)]
                if time_w is not None:
                    dt = max(abs(int(query_ts[start + i]) - int(ts[start + j])), 1)
                    bucket = math.log(dt) / 0.301 if bucketing == "log" else math.sqrt(dt)
                    bias[i, j] += time_w[min(int(bucket), time_w.numel() - 1)]
        pos = torch.tensor([min(i, hist) for i in range(n)], dtype=torch.float64)
        norm = 1.0 / (pos + 1) if silu_scale is None else torch.full((n,), silu_scale, dtype=torch.float64)
        heads = []
        for h in range(q.shape[1]):
            qs, ks, vs = (x[start : start + n, h].double() for x in (q, k, v))
            attn = F.silu(alpha * qs @ ks.T + bias) * norm[:, None] * mask
            heads.append(attn @ vs)
        outs.append(torch.stack(heads, 1))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize(
    "case",
    ["targets,pos+sqrt-time", "targets,context,window,time", "window,no-bias", "targets,context,next-event-time"],
)
def test_reference_matches_naive_spec(case):
    spec = dict(CASES[case])
    options = spec.pop("options")
    tensors, meta = make_batch(**spec)
    tensors = {name: x.cpu().double() if x is not None else None for name, x in tensors.items()}
    meta = {name: x.cpu() if isinstance(x, torch.Tensor) else x for name, x in meta.items()}
    out, _ = run("pytorch", tensors, meta, dtype=torch.float64, **options)
    expected = naive_attention(
        tensors["q"],
        tensors["k"],
        tensors["v"],
        spec["lengths"],
        spec["targets"],
        options["alpha"],
        options["silu_scale"],
        options.get("contextual_len", 0),
        options.get("max_attn_len", 0),
        tensors["pos_w"],
        tensors["time_w"],
        meta["timestamps"],
        meta["bucketing"],
        meta["query_times"],
    )
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-7)  # the reference rounds 1/(pos+1) to fp32
