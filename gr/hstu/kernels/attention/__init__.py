"""One jagged HSTU attention API over several backends.

* ``pytorch``: the padded reference; runs on any device; the ground truth in tests.
* ``cpu``: length-grouped, chunked, recomputing; the fast path for CPU tensors.
* ``triton``: fused Triton kernels for CUDA (on CPU tensors under ``TRITON_INTERPRET=1``).
* ``ascend``: RecSDK's ``torch.ops.mxrec.hstu_jagged`` when installed, else ``ascend_triton``;
  a call the op cannot take is an error (with ``auto``: a logged fallback to ``ascend_triton``).
* ``ascend_triton``: the Triton kernels written to triton-ascend's NPU constraints.
* ``auto``: by the tensors' device (cuda -> triton, npu -> ascend, cpu -> cpu).

Every backend is a module of this package (``triton``: a package of its entry ``cuda``, host code
``host``, device code ``blocks`` and tile ``tuning``) whose entry takes one ``AttentionCall`` and its own options by
keyword: ``entry(call, **options)``; the call is checked once, here. Backends load on first use,
so a missing triton or NPU package only matters when asked for. ``cost`` holds the memory and
work estimates of the ``cpu`` backend that ``gr.train.memory`` sums.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import import_module
from typing import Any, Callable, Dict, List, Optional

from torch import Tensor

from gr.hstu.kernels.attention.common import AttentionCall, AttentionOptions, AttentionWorkspace, RelativeBias

__all__ = [
    "AttentionCall",
    "AttentionOptions",
    "AttentionWorkspace",
    "RelativeBias",
    "hstu_attention",
    "available_backends",
    "backend_entry",
    "resolve_backend",
]

_BACKENDS: Dict[str, str] = {  # name -> "module:function"
    "pytorch": "gr.hstu.kernels.attention.pytorch:pytorch_hstu_attention",
    "cpu": "gr.hstu.kernels.attention.cpu:cpu_hstu_attention",
    "triton": "gr.hstu.kernels.attention.triton.cuda:triton_hstu_attention",
    "ascend": "gr.hstu.kernels.attention.ascend:ascend_hstu_attention",
    "ascend_triton": "gr.hstu.kernels.attention.ascend_triton:ascend_triton_hstu_attention",
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


def backend_entry(name: str, table: Optional[Dict[str, str]] = None) -> Callable[..., Tensor]:
    """The entry ``(call, **options)`` of backend ``name`` (of ``available_backends()``), in ``table``
    ({name: "module:function"}; default: this op's), imported now: an unknown name or a missing
    package is a clear error."""
    if name not in _BACKENDS:
        raise ValueError(f"hstu_attention: unknown backend {name!r}; available: {available_backends()} or 'auto'")
    try:
        return _entry((_BACKENDS if table is None else table)[name])
    except ImportError as err:
        raise ImportError(
            f"hstu_attention: backend {name!r} needs a package that is not installed ({err}); "
            "triton comes with the 'cuda'/'test' extras, triton-ascend and torch-npu with 'ascend'"
        ) from err


@lru_cache(maxsize=None)
def _entry(spec: str) -> Callable[..., Tensor]:
    """The function ``spec`` ("module:function") names, imported once (a failed import is retried)."""
    module, function = spec.split(":")
    return getattr(import_module(module), function)


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

    q, k: [T, H, Dqk] float, v: [T, H, Dv] float; seq_offsets: [B+1] int64; max_seq_len, num_targets
        ([B] or None), rab: as ``AttentionCall`` documents them; contextual_len, max_attn_len, alpha,
        silu_scale: as ``AttentionOptions`` does (a layer's: ``**options.keywords()``)
    backend: one of ``available_backends()`` or "auto" (by q's device)
    workspace: the batch's ``AttentionWorkspace`` when several layers attend over one batch:
        backends that can reuse the batch's layout and bias buckets across calls keep them there
    returns: [T, H, Dv]
    """
    call = AttentionCall(
        q, k, v, seq_offsets, max_seq_len, num_targets, contextual_len, max_attn_len, alpha, silu_scale, rab
    )
    call.validate()
    name = resolve_backend(backend, q.device.type)
    # "auto" on an NPU lets the vendor op's misfits fall back to the NPU Triton kernels
    options: Dict[str, Any] = {"explicit": False} if name == "ascend" and backend == "auto" else {}
    if workspace is not None and name in _WORKSPACE_BACKENDS:
        options["workspace"] = workspace
    return backend_entry(name)(call, **options)
