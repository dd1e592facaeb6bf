"""Non-finite values are errors: ``NonFiniteError`` and ``non_finite``, the check behind it.

Used by training (loss and gradients every step, weights at every checkpoint) and by
``gr.export`` (``check`` refuses exported weights that are not all finite).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Sequence, Tuple

import torch


class NonFiniteError(ArithmeticError):
    """A loss, gradient or weight holds NaN or an infinity; the message names which and where."""


# Elements checked at once: ``isfinite`` needs ~7 bytes of temporaries an element (|x|, two masks,
# their and), so a whole embedding table at once would briefly need ~2x its own size again.
CHECK_CHUNK_ELEMENTS = 1 << 22


def non_finite(named: Iterable[Tuple[str, Any]]) -> List[str]:
    """Names of the floating-point tensors among ``named`` ((name, value) pairs) holding NaN or
    an infinity. A sharded value (ShardedTensor, DTensor) is checked on this rank's shards;
    values that are not tensors are skipped. Checked ``CHECK_CHUNK_ELEMENTS`` at a time."""
    bad = []
    for name, value in named:
        for local in _local_tensors(value):
            if local.is_floating_point() and not all_finite(local):
                bad.append(name)
                break
    return bad


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (floating point) holds no NaN or infinity, in chunks of
    ``CHECK_CHUNK_ELEMENTS`` (a non-contiguous tensor by its leading rows)."""
    flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor
    if flat.dim() == 0:
        return bool(flat.isfinite())
    step = max(1, CHECK_CHUNK_ELEMENTS // max(1, flat[0].numel()))
    return all(bool(flat[start : start + step].isfinite().all()) for start in range(0, flat.shape[0], step))


def gradients_finite(grads: Sequence[torch.Tensor]) -> bool:
    """True when no tensor among ``grads`` holds NaN or an infinity: one fused pass per device and
    dtype (the check behind AMP's gradient scaler, unscaling by 1: each tensor is rewritten in
    place with the same values), instead of a check and a host sync per tensor. For gradients
    only: weights may be read-only. Values that are not plain floating-point tensors (sharded
    gradients) go through ``non_finite``."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for grad in grads:
        if type(grad) is not torch.Tensor or grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            if non_finite([("", grad)]):
                return False
            continue
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, _), tensors in groups.items():
        found = torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, torch.ones(1, device=device))
        if bool(found):
            return False
    return True


def _local_tensors(value: Any) -> List[torch.Tensor]:
    if hasattr(value, "local_shards"):  # torch.distributed._shard ShardedTensor
        return [shard.tensor for shard in value.local_shards()]
    if hasattr(value, "to_local"):  # DTensor
        return [value.to_local()]
    return [value] if isinstance(value, torch.Tensor) else []
