"""Non-finite values are errors: ``NonFiniteError`` and ``non_finite``, the check behind it.

Used by training (loss and gradients every step, weights at every checkpoint) and by
``gr.export`` (``check`` refuses exported weights that are not all finite).
"""

from __future__ import annotations

from typing import Any, Iterable, List, Tuple

import torch


class NonFiniteError(ArithmeticError):
    """A loss, gradient or weight holds NaN or an infinity; the message names which and where."""


def non_finite(named: Iterable[Tuple[str, Any]]) -> List[str]:
    """Names of the floating-point tensors among ``named`` ((name, value) pairs) holding NaN or
    an infinity. A sharded value (ShardedTensor, DTensor) is checked on this rank's shards;
    values that are not tensors are skipped."""
    bad = []
    for name, value in named:
        for local in _local_tensors(value):
            if local.is_floating_point() and not bool(local.isfinite().all()):
                bad.append(name)
                break
    return bad


def _local_tensors(value: Any) -> List[torch.Tensor]:
    if hasattr(value, "local_shards"):  # torch.distributed._shard ShardedTensor
        return [shard.tensor for shard in value.local_shards()]
    if hasattr(value, "to_local"):  # DTensor
        return [value.to_local()]
    return [value] if isinstance(value, torch.Tensor) else []
