"""The Ascend backend without an NPU: our arguments mapped onto RecSDK's
``torch.ops.mxrec.hstu_jagged`` (a stand-in op implementing RecSDK's documented semantics
replaces the lookup), refusals of what it cannot express, the fallback to the triton-ascend
kernels, their work list, and imports that stay lazy. Nothing here ran on an NPU."""

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from gr.hstu.kernels.attention import RelativeBias, ascend, hstu_attention

pytestmark = pytest.mark.attention


class FakeHstuJagged:
    """RecSDK's hstu_jagged golden math (its tests' reference): per sequence,
    SiLU(alpha * (q k^T + attn_bias)) * silu_scale * mask @ v with mask_type 0 = causal, the
    trailing num_target tokens seeing the history and (target_group_size 1) themselves.

    It refuses what the real op's TORCH_CHECKs refuse (Ascend/RecSDK,
    cust_op/framework/torch_plugin/torch_library/hstu/hstu_jagged.cpp): head dims outside
    [16, 512] or not multiples of 16, q / k / v of different sizes when gradients will flow,
    attn_bias other than [B, H, max_seq_len, max_seq_len] in q's dtype, num_target without
    num_context, target_group_size outside {1, 3}."""

    def __init__(self):
        self.calls = []

    def __call__(
        self,
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
        alpha=1.0,
    ):
        batch_size, heads = seq_offset.numel() - 1, q.shape[1]
        for dim in (q.shape[2], v.shape[2]):
            if not 16 <= dim <= 512 or dim % 16:
                raise RuntimeError(f"headDim expect in [16, 512], but value is {dim}")
        if any(x.requires_grad for x in (q, k, v)) and not q.shape == k.shape == v.shape:
            raise RuntimeError("Q and V batch size check failed")
        if attn_bias is not None and (
            tuple(attn_bias.shape) != (batch_size, heads, max_seq_len, max_seq_len) or attn_bias.dtype != q.dtype
        ):
            raise RuntimeError("The attnBias should be 4D in normal layout")
        if (num_target is None) != (num_context is None):
            raise RuntimeError("numContext is required when numTarget or targetGroupSize is not None")
        if num_target is not None and target_group_size not in (1, 3):
            raise RuntimeError("The targetGroupSize should be in [1, 3]")
        self.calls.append(
            dict(
                mask=mask,
                mask_type=mask_type,
                max_seq_len=max_seq_len,
                silu_scale=silu_scale,
                num_context=num_context,
                target_group_size=target_group_size,
                alpha=alpha,
                bias_shape=None if attn_bias is None else tuple(attn_bias.shape),
            )
        )
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
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    call = fake.calls[0]
    assert call["mask"] is None and call["mask_type"] == 0 and call["num_context"].tolist() == [0, 0, 0, 0]
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
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
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
    with pytest.raises(ValueError, match=rf"mxrec.hstu_jagged cannot take {named}.*ascend_triton"):
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
    from gr.hstu.kernels.attention.ascend_triton import work_list

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
        "from gr.hstu.kernels.attention import hstu_attention\n"
        "x = torch.randn(5, 1, 4)\n"
        "hstu_attention(x, x, x, torch.tensor([0, 5]), 5, backend='cpu')\n"
        "hstu_attention(x, x, x, torch.tensor([0, 5]), 5, backend='pytorch')\n"
        "print(sorted(m for m in ('triton', 'torch_npu') if m in sys.modules))\n"
    )
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.strip() == "[]"


class OldFakeHstuJagged(FakeHstuJagged):
    """A RecSDK version whose hstu_jagged has no alpha argument."""

    def __call__(
        self,
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
    ):
        return super().__call__(
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
        )


def batch_with_dims(dim_qk, dim_v, seed=0):
    (q, k, v, pos_w, time_w), offsets, ts, targets = batch(seed)
    g = torch.Generator().manual_seed(seed + 1)
    q, k = (torch.randn(q.shape[0], 2, dim_qk, generator=g) for _ in range(2))
    v = torch.randn(q.shape[0], 2, dim_v, generator=g)
    return [q, k, v, pos_w, time_w], offsets, ts, targets


MISFITS = [
    (FakeHstuJagged, 50, 50, 0.3, r"attention_dim \(q, k head dim\)=50 \(must be a multiple of 16 in \[16, 512\]\)"),
    (FakeHstuJagged, 16, 32, 0.3, r"attention_dim 16 != linear_dim 32 with gradients"),
    (OldFakeHstuJagged, 16, 16, 0.3, r"alpha=0.3 \(this RecSDK version's hstu_jagged has no alpha argument\)"),
]
MISFIT_IDS = ["head-dim-50", "qk-16-v-32-backward", "alpha-on-an-old-op"]


@pytest.mark.parametrize("fake_class, dim_qk, dim_v, alpha, named", MISFITS, ids=MISFIT_IDS)
def test_explicit_ascend_refuses_a_misfit_before_calling_the_op(monkeypatch, fake_class, dim_qk, dim_v, alpha, named):
    fake = fake_class()
    monkeypatch.setattr(ascend, "find_mxrec_hstu_jagged", lambda: fake)
    tensors, offsets, ts, targets = batch_with_dims(dim_qk, dim_v)
    with pytest.raises(ValueError, match=named):
        run("ascend", tensors, offsets, ts, targets, alpha=alpha, silu_scale=1 / 30)
    assert fake.calls == []


@pytest.mark.parametrize("fake_class, dim_qk, dim_v, alpha, named", MISFITS, ids=MISFIT_IDS)
def test_auto_falls_back_to_triton_ascend_on_a_misfit_with_the_reason_logged(
    monkeypatch, caplog, fake_class, dim_qk, dim_v, alpha, named
):
    """backend="auto" on an NPU (resolved to "ascend"; the device faked by resolve_backend)."""
    import gr.hstu.kernels.attention as kernels

    fake = fake_class()
    monkeypatch.setattr(ascend, "find_mxrec_hstu_jagged", lambda: fake)
    monkeypatch.setattr(kernels, "resolve_backend", lambda backend, _: "ascend" if backend == "auto" else backend)
    tensors, offsets, ts, targets = batch_with_dims(dim_qk, dim_v)
    with caplog.at_level("WARNING", logger=ascend.__name__):
        got = run("auto", tensors, offsets, ts, targets, alpha=alpha, silu_scale=1 / 30)
    assert fake.calls == []
    assert re.search(named, caplog.text) and "running ascend_triton instead" in caplog.text
    want = run("pytorch", tensors, offsets, ts, targets, alpha=alpha, silu_scale=1 / 30)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_old_op_without_alpha_is_called_without_it_when_alpha_is_one(monkeypatch):
    fake = OldFakeHstuJagged()
    monkeypatch.setattr(ascend, "find_mxrec_hstu_jagged", lambda: fake)
    tensors, offsets, ts, targets = batch()
    got = run("ascend", tensors, offsets, ts, targets, alpha=1.0, silu_scale=1 / 30)
    want = run("pytorch", tensors, offsets, ts, targets, alpha=1.0, silu_scale=1 / 30)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert len(fake.calls) == 1
