"""One jagged HSTU attention API over several backends.

* ``pytorch``: the padded reference; runs on any device; the ground truth in tests.
* ``cpu``: length-grouped, chunked, recomputing; the fast path for CPU tensors.
* ``triton``: fused Triton kernels for CUDA (on CPU tensors under ``TRITON_INTERPRET=1``).
* ``ascend``: RecSDK's ``torch.ops.mxrec.hstu_jagged`` when installed, else ``ascend_triton``;
  a call the op cannot take is an error (with ``auto``: a logged fallback to ``ascend_triton``).
* ``ascend_triton``: the Triton kernels written to triton-ascend's NPU constraints.
* ``auto``: by the tensors' device (cuda -> triton, npu -> ascend, cpu -> cpu).

``hstu_cached_attention`` is the serving analogue: new tokens against cached K/V plus
themselves, with the same backend names (``cpu``: fast path; ``pytorch``: reference;
``triton``/``ascend``/``ascend_triton``: through that backend's training kernel).

Backends load on first use, so a missing triton or NPU package only matters when asked for.
"""

from __future__ import annotations

from importlib import import_module
from typing import Callable, Dict, List, Optional

from torch import Tensor

from gr.hstu.kernels.cached_common import check_inputs
from gr.hstu.kernels.common import AttentionWorkspace, RelativeBias

__all__ = [
    "AttentionWorkspace",
    "RelativeBias",
    "hstu_attention",
    "hstu_cached_attention",
    "available_backends",
    "resolve_backend",
]

_BACKENDS: Dict[str, str] = {  # name -> "module:function"
    "pytorch": "gr.hstu.kernels.pytorch:pytorch_hstu_attention",
    "cpu": "gr.hstu.kernels.cpu:cpu_hstu_attention",
    "triton": "gr.hstu.kernels.triton_attention:triton_hstu_attention",
    "ascend": "gr.hstu.kernels.ascend:ascend_hstu_attention",
    "ascend_triton": "gr.hstu.kernels.ascend_triton:ascend_triton_hstu_attention",
}
_CACHED_BACKENDS: Dict[str, str] = {
    "pytorch": "gr.hstu.kernels.pytorch_cached:pytorch_hstu_cached_attention",
    "cpu": "gr.hstu.kernels.cpu_cached:cpu_hstu_cached_attention",
}
_AUTO = {"cuda": "triton", "npu": "ascend", "cpu": "cpu"}
_WORKSPACE_BACKENDS = ("cpu",)  # backends that keep per-batch work in an AttentionWorkspace


def available_backends() -> List[str]:
    return sorted(_BACKENDS)


def resolve_backend(backend: str, device_type: str) -> str:
    """Map "auto" to a backend for tensors on ``device_type`` (others: ``pytorch``)."""
    if backend != "auto":
        return backend
    return _AUTO.get(device_type, "pytorch")


def _load(name: str, table: Dict[str, str] = _BACKENDS) -> Callable[..., Tensor]:
    if name not in _BACKENDS:
        raise ValueError(f"hstu_attention: unknown backend {name!r}; available: {available_backends()} or 'auto'")
    module, function = table[name].split(":")
    try:
        return getattr(import_module(module), function)
    except ImportError as err:
        raise ImportError(
            f"hstu_attention: backend {name!r} needs a package that is not installed ({err}); "
            "triton comes with the 'cuda'/'test' extras, triton-ascend and torch-npu with 'ascend'"
        ) from err


def hstu_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    seq_offsets: Tensor,
    max_seq_len: int,
    *,
    num_targets: Optional[Tensor] = None,
    contextual_len: int = 0,
    max_attn_len: int = 0,
    alpha: float = 1.0,
    silu_scale: Optional[float] = None,
    rab: Optional[RelativeBias] = None,
    backend: str = "auto",
    workspace: Optional[AttentionWorkspace] = None,
) -> Tensor:
    """Jagged HSTU attention: ``out_i = sum_j mask_ij * SiLU(alpha q_i.k_j + rab_ij) * norm_i * v_j``.

    q: [T, H, Dqk] float
    k: [T, H, Dqk] float
    v: [T, H, Dv] float
    seq_offsets: [B+1] int64
    max_seq_len: int, >= the longest sequence in the batch (targets included)
    num_targets: [B] int64 or None: trailing candidate tokens per sequence
    contextual_len: leading tokens visible to every token
    max_attn_len: look-back window in positions, 0 = unbounded
    silu_scale: norm_i; None -> 1 / (pos_i + 1) (per-sequence length so far)
    rab: relative bias parts (``RelativeBias``) or None
    backend: one of ``available_backends()`` or "auto" (by q's device)
    workspace: the batch's ``AttentionWorkspace`` when several layers attend over one batch:
        backends that can reuse the batch's layout and bias buckets across calls keep them there
    returns: [T, H, Dv]
    """
    name = resolve_backend(backend, q.device.type)
    # "auto" on an NPU lets the vendor op's misfits fall back to the NPU Triton kernels
    options = {"explicit": False} if name == "ascend" and backend == "auto" else {}
    if workspace is not None and name in _WORKSPACE_BACKENDS:
        options["workspace"] = workspace
    return _load(name)(
        q, k, v, seq_offsets, max_seq_len, num_targets, contextual_len, max_attn_len, alpha, silu_scale, rab, **options
    )


def hstu_cached_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    new_offsets: Tensor,
    cache_k: Tensor,
    cache_v: Tensor,
    cache_offsets: Tensor,
    *,
    new_tokens: str = "targets",
    positions: Optional[Tensor] = None,
    block_visible: Optional[Tensor] = None,
    contextual_len: int = 0,
    max_attn_len: int = 0,
    alpha: float = 1.0,
    silu_scale: Optional[float] = None,
    rab: Optional[RelativeBias] = None,
    cache_timestamps: Optional[Tensor] = None,
    backend: str = "auto",
) -> Tensor:
    """HSTU attention of new tokens over their request's cached K/V and the new tokens themselves.

    The rows equal those of ``hstu_attention`` over each request's history followed by its new
    tokens (cached key j of a request sits at position j). B requests run in one call.

    q, k: [N, H, Da] float, v: [N, H, Dl] float: the new tokens' projections
    new_offsets: [B+1] int64 over the N new tokens
    cache_k: [H, C, Da] float, cache_v: [H, C, Dl] float: the requests' cached keys and values,
        head-major (the layout ``gr.hstu.cache.HistoryCache`` keeps), jagged over C; or B
        per-request tensors [H, C_b, *] (no copy of several users' caches into one)
    cache_offsets: [B+1] int64 over the C cached tokens
    new_tokens: "targets" (candidates at position C_b: each sees the history and itself) or
        "history" (the history goes on: causal among themselves, positions C_b, C_b + 1, ...)
    positions: [N] int64 or None: explicit positions of new history tokens (draft trees)
    block_visible: [N, N] bool or None: further restricts which new history token sees which
        (a draft tree's branches); only entries within one request are read
    contextual_len, max_attn_len, alpha, silu_scale: as in ``hstu_attention``
    rab: ``RelativeBias`` of the new tokens (``timestamps``/``query_times``: [N] int64) or None
    cache_timestamps: [C] int64 seconds of the cached tokens (or B per-request [C_b]); required
        with a time bias
    backend: one of ``available_backends()`` or "auto" (by q's device)
    returns: [N, H, Dl]
    """
    check_inputs(q, k, v, new_offsets, cache_k, cache_v, cache_offsets, rab, cache_timestamps)
    name = resolve_backend(backend, q.device.type)
    args = (
        q,
        k,
        v,
        new_offsets,
        cache_k,
        cache_v,
        cache_offsets,
        new_tokens,
        positions,
        block_visible,
        contextual_len,
        max_attn_len,
        alpha,
        silu_scale,
        rab,
        cache_timestamps,
    )
    if name in _CACHED_BACKENDS:
        return _load(name, _CACHED_BACKENDS)(*args)
    from gr.hstu.kernels.cached_by_concat import concat_hstu_cached_attention

    _load(name)  # a missing package is the same clear error as for the training op
    return concat_hstu_cached_attention(*args, backend=name)
