"""The Ascend backend without an NPU: our arguments mapped onto RecSDK's
``torch.ops.mxrec.hstu_jagged`` (a stand-in op implementing RecSDK's documented semantics
replaces the lookup), refusals of what it cannot express, the fallback to the triton-ascend
kernels, their work list, and imports that stay lazy. Nothing here ran on an NPU."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel modules are first imported

from gr.hstu.kernels import RelativeBias, hstu_attention  # noqa: E402
from gr.hstu.kernels import ascend  # noqa: E402

pytestmark = pytest.mark.attention


class FakeHstuJagged:
    """RecSDK's hstu_jagged golden math (its tests' reference): per sequence,
    SiLU(alpha * (q k^T + attn_bias)) * silu_scale * mask @ v with mask_type 0 = causal, the
    trailing num_target tokens seeing the history and (target_group_size 1) themselves."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, mask, attn_bias, mask_type, max_seq_len, silu_scale, seq_offset, num_context,
                 num_target, target_group_size, alpha):
        self.calls.append(dict(mask=mask, mask_type=mask_type, max_seq_len=max_seq_len, silu_scale=silu_scale,
                               num_context=num_context, target_group_size=target_group_size, alpha=alpha,
                               bias_shape=None if attn_bias is None else tuple(attn_bias.shape)))
        outs = []
        for b in range(seq_offset.numel() - 1):
            start, end = int(seq_offset[b]), int(seq_offset[b + 1])
            n = end - start
            hist = n - (int(num_target[b]) if num_target is not None else 0)
            mask_b = torch.tril(torch.ones(n, n))
            mask_b[hist:, hist:] = torch.eye(n - hist)
            qk = torch.einsum("nhd,mhd->hnm", q[start:end], k[start:end])
            if attn_bias is not None:
                qk = qk + attn_bias[b, :, :n, :n]
            attn = F.silu(alpha * qk) * silu_scale * mask_b
            outs.append(torch.einsum("hnm,mhd->nhd", attn, v[start:end]))
        return torch.cat(outs).reshape(q.shape[0], -1)  # flat heads, as RecSDK returns


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 9, 30, 4]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])
    total = sum(lengths)
    tensors = [torch.randn(total, 2, 16, generator=g) for _ in range(3)]
    tensors += [torch.randn(40, generator=g), torch.randn(16, generator=g)]  # position, time bias weights
    ts = torch.cat([torch.sort(torch.randint(0, 10**6, (n,), generator=g)).values for n in lengths])
    return tensors, offsets, ts, torch.tensor([0, 3, 5, 4])


def run(backend, tensors, offsets, ts, targets, query_ts=None, **options):
    leaves = [x.clone().requires_grad_(True) for x in tensors]
    rab = RelativeBias(leaves[3], leaves[4], ts, query_times=query_ts)
    out = hstu_attention(*leaves[:3], offsets, 30, num_targets=targets, rab=rab, backend=backend, **options)
    return (out, *torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), leaves))


def test_mxrec_mapping_matches_reference_forward_and_gradients(monkeypatch):
    fake = FakeHstuJagged()
    monkeypatch.setattr(ascend, "find_mxrec_hstu_jagged", lambda: fake)
    tensors, offsets, ts, targets = batch()
    options = dict(alpha=0.3, silu_scale=1 / 30)
    got = run("ascend", tensors, offsets, ts, targets, **options)
    want = run("pytorch", tensors, offsets, ts, targets, **options)
    for name, a, b in zip(["out", "dq", "dk", "dv", "dpos_w", "dtime_w"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    call = fake.calls[0]
    assert call["mask"] is None and call["mask_type"] == 0 and call["num_context"] is None
    assert call["target_group_size"] == 1 and call["max_seq_len"] == 30 and call["alpha"] == 0.3
    assert call["bias_shape"] == (4, 2, 30, 30)


def test_mxrec_mapping_measures_time_from_query_times(monkeypatch):
    """Next-event query times reach RecSDK's op through the dense bias: it matches the reference
    with query times, which differs from the bias on the tokens' own times."""
    fake = FakeHstuJagged()
    monkeypatch.setattr(ascend, "find_mxrec_hstu_jagged", lambda: fake)
    tensors, offsets, ts, targets = batch()
    query_ts = ts + torch.randint(1, 10**4, ts.shape, generator=torch.Generator().manual_seed(1))
    options = dict(alpha=0.3, silu_scale=1 / 30)
    got = run("ascend", tensors, offsets, ts, targets, query_ts=query_ts, **options)
    want = run("pytorch", tensors, offsets, ts, targets, query_ts=query_ts, **options)
    for name, a, b in zip(["out", "dq", "dk", "dv", "dpos_w", "dtime_w"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    own_times = run("pytorch", tensors, offsets, ts, targets, **options)
    assert not torch.allclose(got[0], own_times[0], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(silu_scale=None), "silu_scale=None"),
        (dict(silu_scale=0.1, contextual_len=2), "contextual_len=2"),
        (dict(silu_scale=0.1, max_attn_len=8), "max_attn_len=8"),
        (dict(silu_scale=0.0), "silu_scale=0.0"),
    ],
)
def test_mxrec_refuses_what_it_cannot_express(monkeypatch, options, named):
    fake = FakeHstuJagged()
    monkeypatch.setattr(ascend, "find_mxrec_hstu_jagged", lambda: fake)
    tensors, offsets, ts, targets = batch()
    with pytest.raises(ValueError, match=rf"mxrec.hstu_jagged cannot express {named}.*ascend_triton"):
        run("ascend", tensors, offsets, ts, targets, alpha=0.3, **options)
    assert fake.calls == []


def test_without_mxrec_ascend_runs_the_triton_ascend_kernels(monkeypatch):
    """No RecSDK op: the same call (per-position norm, which RecSDK would refuse) goes to the
    NPU Triton kernels, here interpreted."""
    monkeypatch.setattr(ascend, "find_mxrec_hstu_jagged", lambda: None)
    tensors, offsets, ts, targets = batch()
    got = run("ascend", tensors, offsets, ts, targets, alpha=0.3, silu_scale=None)
    want = run("pytorch", tensors, offsets, ts, targets, alpha=0.3, silu_scale=None)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_npu_work_list_covers_every_block_once_costliest_first():
    from gr.hstu.kernels.ascend_triton import work_list

    lengths = [70, 0, 1, 200, 64]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])
    seq, start = work_list(offsets, 64, query_major=True)
    expected = {(b, s) for b, n in enumerate(lengths) for s in range(0, n, 64)}
    assert sorted(zip(seq.tolist(), start.tolist())) == sorted(expected)
    assert start.tolist() == sorted(start.tolist(), reverse=True)  # later query blocks see more keys
    seq, start = work_list(offsets, 64, query_major=False)
    rows_after = [lengths[b] - s for b, s in zip(seq.tolist(), start.tolist())]
    assert rows_after == sorted(rows_after, reverse=True)  # earlier key blocks are seen by more rows


def test_kernel_packages_load_only_when_their_backend_is_used():
    code = (
        "import sys, torch\n"
        "from gr.hstu.kernels import hstu_attention\n"
        "x = torch.randn(5, 1, 4)\n"
        "hstu_attention(x, x, x, torch.tensor([0, 5]), 5, backend='cpu')\n"
        "hstu_attention(x, x, x, torch.tensor([0, 5]), 5, backend='pytorch')\n"
        "print(sorted(m for m in ('triton', 'torch_npu') if m in sys.modules))\n"
    )
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "[]"
