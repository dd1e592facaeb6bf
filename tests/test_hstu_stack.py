"""The HSTU stack against a naive per-sequence implementation written here from the paper."""

import math

import pytest
import torch
import torch.nn.functional as F

from gr.hstu import HSTU, HSTUConfig


def naive_visible(n, h, c, w):
    """Dense [n, n] mask from the spec: causal history, isolated targets, context, window."""
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            if i == j:
                m[i, j] = True
                continue
            if j >= h:  # a target column: only its own row
                continue
            if j < c:  # contextual history token: visible to everyone
                m[i, j] = True
                continue
            pi = min(i, h)
            d = pi - j
            m[i, j] = d > 0 and (w == 0 or d <= w)
    return m


def naive_hstu(model: HSTU, x, lengths, timestamps, num_targets):
    cfg = model.config
    outs = []
    start = 0
    for b, n in enumerate(lengths):
        t = num_targets[b] if num_targets is not None else 0
        h_len = n - t
        xs = x[start : start + n]
        ts = timestamps[start : start + n].double()
        pos = torch.tensor([min(i, h_len) for i in range(n)])
        hid = xs * math.sqrt(cfg.hidden_dim) if cfg.scale_input else xs
        if model.position_embedding is not None:
            hid = hid + model.position_embedding.weight[pos]
        mask = naive_visible(n, h_len, cfg.contextual_len, cfg.max_attn_len).float()
        for layer in model.layers:
            normed = F.layer_norm(
                hid, (cfg.hidden_dim,), layer.input_norm.weight, layer.input_norm.bias, cfg.layer_norm_eps
            )
            proj = F.silu(normed @ layer.uvqk.weight.T + layer.uvqk.bias)
            H, dl, da = cfg.num_heads, cfg.linear_dim, cfg.attention_dim
            u = proj[:, : H * dl]
            v = proj[:, H * dl : 2 * H * dl].reshape(n, H, dl)
            q = proj[:, 2 * H * dl : 2 * H * dl + H * da].reshape(n, H, da)
            k = proj[:, 2 * H * dl + H * da :].reshape(n, H, da)
            bias = torch.zeros(n, n)
            if layer.position_bias is not None:
                P = layer.position_bias.numel()
                rel = (pos[:, None] - pos[None, :]).clamp(0, P - 1)
                bias = bias + layer.position_bias[rel]
            if layer.time_bias is not None:
                dt = (ts[:, None] - ts[None, :]).abs().clamp(min=1)
                bucket = torch.log(dt) / 0.301 if cfg.time_bucketing == "log" else torch.sqrt(dt)
                bias = bias + layer.time_bias[bucket.long().clamp(0, layer.time_bias.numel() - 1)]
            if cfg.attn_norm == "max_seq_len":
                norm = torch.full((n, 1), 1.0 / cfg.max_seq_len)
            else:
                norm = 1.0 / (pos.float() + 1).view(n, 1)
            heads_out = []
            for hh in range(H):
                a = F.silu(cfg.alpha * q[:, hh] @ k[:, hh].T + bias) * norm * mask
                heads_out.append(a @ v[:, hh])
            av = torch.cat(heads_out, dim=-1)
            y = F.layer_norm(av, (H * dl,), layer.attn_norm.weight, layer.attn_norm.bias, cfg.layer_norm_eps) * u
            hid = hid + y @ layer.output.weight.T + layer.output.bias
        outs.append(hid)
        start += n
    return torch.cat(outs)


def random_batch(lengths, dim, with_targets, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths_t = torch.tensor(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths_t.cumsum(0)])
    total = int(offsets[-1])
    x = torch.randn(total, dim, generator=g, dtype=torch.float64)
    ts = torch.cat([torch.sort(torch.randint(0, 10**7, (n,), generator=g)).values for n in lengths])
    targets = None
    if with_targets:
        targets = torch.tensor([int(torch.randint(0, min(n, 5) + 1, (1,), generator=g)) for n in lengths])
    return x, offsets, ts, targets


CASES = [
    dict(num_heads=2, attn_norm="max_seq_len", time_bucketing="log"),
    dict(num_heads=1, attn_norm="seq_len", time_bucketing="sqrt", contextual_len=3),
    dict(num_heads=2, max_attn_len=17, contextual_len=2),
    dict(num_heads=2, position_buckets=0, time_buckets=0, position_embedding=False, scale_input=False),
]


@pytest.mark.parametrize("with_targets", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_stack_matches_naive_forward_and_gradients(case, with_targets):
    lengths = [1, 7, 310, 2, 45]
    cfg = HSTUConfig(
        hidden_dim=16,
        num_layers=2,
        attention_dim=8,
        linear_dim=6,
        max_seq_len=320,
        dropout=0.0,
        input_dropout=0.0,
        **case,
    )
    model = HSTU(cfg).double()
    x, offsets, ts, targets = random_batch(lengths, 16, with_targets)
    x_fast = x.clone().requires_grad_(True)
    x_slow = x.clone().requires_grad_(True)
    out_fast = model(x_fast, offsets, max(lengths), ts, targets)
    grads_fast = torch.autograd.grad(out_fast.square().sum(), [x_fast, *model.parameters()])
    out_slow = naive_hstu(model, x_slow, lengths, ts, targets)
    grads_slow = torch.autograd.grad(out_slow.square().sum(), [x_slow, *model.parameters()], allow_unused=True)
    torch.testing.assert_close(out_fast, out_slow, rtol=1e-9, atol=1e-9)
    names = ["x"] + [n for n, _ in model.named_parameters()]
    for name, gf, gs in zip(names, grads_fast, grads_slow):
        gs = torch.zeros_like(gf) if gs is None else gs
        torch.testing.assert_close(gf, gs, rtol=1e-8, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


def test_permuting_targets_permutes_their_outputs_only():
    cfg = HSTUConfig(
        hidden_dim=16, attention_dim=8, linear_dim=8, num_heads=2, max_seq_len=64, dropout=0.0, input_dropout=0.0
    )
    model = HSTU(cfg).eval()
    hist, n_targets = 20, 6
    x = torch.randn(hist + n_targets, 16)
    ts = torch.cat([torch.arange(hist) * 1000, torch.full((n_targets,), 10**6)])
    offsets = torch.tensor([0, hist + n_targets])
    num_targets = torch.tensor([n_targets])
    out = model(x, offsets, hist + n_targets, ts, num_targets)
    perm = torch.randperm(n_targets)
    x_perm = torch.cat([x[:hist], x[hist:][perm]])
    out_perm = model(x_perm, offsets, hist + n_targets, ts, num_targets)
    torch.testing.assert_close(out_perm[:hist], out[:hist])
    torch.testing.assert_close(out_perm[hist:], out[hist:][perm])
    # A target scored alone gives the same output as among the others.
    alone = model(
        torch.cat([x[:hist], x[hist + 2 : hist + 3]]),
        torch.tensor([0, hist + 1]),
        hist + 1,
        ts[: hist + 1],
        torch.tensor([1]),
    )
    torch.testing.assert_close(alone[hist], out[hist + 2])


def test_history_longer_than_config_is_refused():
    model = HSTU(HSTUConfig(hidden_dim=8, attention_dim=4, linear_dim=4, max_seq_len=5))
    x = torch.randn(7, 8)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(x, torch.tensor([0, 7]), 7, torch.arange(7))


def test_hstu_cannot_be_subclassed():
    with pytest.raises(TypeError, match="HSTUConfig"):

        class MyHSTU(HSTU):  # noqa: F841
            pass


@pytest.mark.parametrize("mode", ["attention", "layer"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32-fused-on-cpu"])
def test_recompute_gives_the_same_outputs_and_gradients(mode, dtype):
    """float32 runs gr.hstu.kernels.layer_ops' fused ops where they build: their dropout masks are replayed
    too (checkpoint restores the generator they draw their seeds from); the weight gradients' per-thread
    sums may add up in another order, hence fp32 tolerances."""
    base = dict(
        hidden_dim=16, attention_dim=8, linear_dim=8, num_heads=2, max_seq_len=64, dropout=0.3, input_dropout=0.1
    )
    plain = HSTU(HSTUConfig(**base)).to(dtype).train()
    recomputed = HSTU(HSTUConfig(**base, recompute=mode)).to(dtype).train()
    recomputed.load_state_dict(plain.state_dict())
    x, offsets, ts, targets = random_batch([5, 40, 1, 17], 16, with_targets=True)
    grads = []
    for model in (plain, recomputed):
        torch.manual_seed(7)  # same dropout masks; recompute must replay them exactly
        xg = x.to(dtype).clone().requires_grad_(True)
        out = model(xg, offsets, 40, ts, targets)
        grads.append((out.detach(), *torch.autograd.grad(out.square().sum(), [xg, *model.parameters()])))
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, **tolerance)


def test_recompute_saves_fewer_activation_bytes():
    def saved_bytes(mode: str) -> int:
        # The padded reference keeps [B, H, L, L] scores for backward: the case recompute is for
        # (the cpu backend already recomputes them and saves little either way).
        cfg = HSTUConfig(
            hidden_dim=32,
            attention_dim=16,
            linear_dim=16,
            num_heads=2,
            max_seq_len=256,
            num_layers=3,
            recompute=mode,
            kernel_backend="pytorch",
        )
        model = HSTU(cfg).train()
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randn(400, 32, requires_grad=True), torch.tensor([0, 200, 400]), 200, torch.arange(400))
        return total

    none, attention, layer = saved_bytes("none"), saved_bytes("attention"), saved_bytes("layer")
    assert layer < attention < none / 3
