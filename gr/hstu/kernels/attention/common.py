"""Definitions every attention backend implements: the call they take, the HSTU mask and the bucketed bias.

Backends may fuse these differently, but the math here is the contract that the
conformance tests hold each of them to.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

import torch
from torch import Tensor

TIME_BUCKET_LOG_DIV = 0.301  # log bucketing: floor(ln(max(|dt|, 1)) / 0.301), as in the HSTU paper code

_Entry = TypeVar("_Entry")  # what an AttentionWorkspace entry holds


@dataclass
class RelativeBias:
    """Bucketed relative attention bias, shared by all heads of one layer.

    bias(i, j) = position_weights[clamp(pos_i - pos_j, 0, P - 1)]
               + time_weights[clamp(bucket(|tq_i - t_j|), 0, NB - 1)]
    Either part may be None (off). ``pos`` is ``gr.jagged.token_positions``
    (targets sit at the history length). ``tq_i`` is the time query i is asked at:
    ``query_times[i]``, or the token's own ``timestamps[i]`` when those are None.

    position_weights: [P] float, or None
    time_weights: [NB] float, or None
    timestamps: [T] int64 seconds; required when time_weights is given
    time_bucketing: "log" or "sqrt"
    query_times: [T] int64 seconds, or None
    """

    position_weights: Optional[Tensor] = None
    time_weights: Optional[Tensor] = None
    timestamps: Optional[Tensor] = None
    time_bucketing: str = "log"
    query_times: Optional[Tensor] = None

    def __post_init__(self) -> None:
        if self.time_weights is not None and self.timestamps is None:
            raise ValueError("RelativeBias.timestamps: required when time_weights is given")
        if self.time_bucketing not in ("log", "sqrt"):
            raise ValueError(f"RelativeBias.time_bucketing: expected 'log' or 'sqrt', got {self.time_bucketing!r}")
        if self.query_times is not None and (
            self.timestamps is None or self.query_times.shape != self.timestamps.shape
        ):
            raise ValueError("RelativeBias.query_times: expected the shape of timestamps [T]")

    @property
    def resolved_query_times(self) -> Optional[Tensor]:
        """[T] int64: the time each query is asked at (``query_times`` or ``timestamps``)."""
        return self.timestamps if self.query_times is None else self.query_times


@dataclass(frozen=True)
class AttentionOptions:
    """What a layer's config fixes for each of its attention calls (``gr.hstu.HSTUConfig.attention_options``):
    the fields of ``AttentionCall`` and ``CachedAttentionCall``, and the keywords of ``hstu_attention``
    and ``hstu_cached_attention``, of these names.

    contextual_len: leading tokens visible to every token
    max_attn_len: look-back window in positions, 0 = unbounded
    alpha: scale of q.k
    silu_scale: norm_i; None -> 1 / (pos_i + 1) (per-sequence length so far)
    """

    contextual_len: int = 0
    max_attn_len: int = 0
    alpha: float = 1.0
    silu_scale: Optional[float] = None

    @classmethod
    def of(cls, call: object) -> "AttentionOptions":
        """The options ``call`` (an ``AttentionCall`` or a ``CachedAttentionCall``) was made with."""
        return cls(**{f.name: getattr(call, f.name) for f in fields(cls)})

    def keywords(self) -> Dict[str, Any]:
        """{name: value} of each option, to pass to ``hstu_attention`` or ``hstu_cached_attention``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One jagged HSTU attention call: what every backend of ``hstu_attention`` takes, by keyword
    (``backend(call, **options)``), checked once by the dispatcher (``validate``).

    q: [T, H, Dqk] float
    k: [T, H, Dqk] float
    v: [T, H, Dv] float
    seq_offsets: [B+1] int64
    max_seq_len: int, >= the longest sequence in the batch (targets included)
    num_targets: [B] int64 or None: trailing candidate tokens per sequence
    contextual_len, max_attn_len, alpha, silu_scale: as ``AttentionOptions`` documents them
    rab: relative bias parts (``RelativeBias``) or None
    """

    q: Tensor
    k: Tensor
    v: Tensor
    seq_offsets: Tensor
    max_seq_len: int
    num_targets: Optional[Tensor] = None
    contextual_len: int = 0
    max_attn_len: int = 0
    alpha: float = 1.0
    silu_scale: Optional[float] = None
    rab: Optional[RelativeBias] = None

    def validate(self, op: str = "hstu_attention") -> None:
        """Shapes, dtypes and devices every backend relies on (no tensor value is read, so no device
        sync); errors name the argument."""
        q = self.q
        check_qkv(op, q, self.k, self.v, "[T, H, Dqk]", "[T, H, Dv]")
        offsets = self.seq_offsets
        if offsets.dim() != 1 or offsets.numel() < 1:
            raise ValueError(f"{op}: seq_offsets must be [B+1], got {tuple(offsets.shape)}")
        check_tensors(op, q, (("seq_offsets", offsets),), floating=False)
        if self.num_targets is not None:
            if tuple(self.num_targets.shape) != (offsets.numel() - 1,):
                raise ValueError(
                    f"{op}: num_targets must be [B] = [{offsets.numel() - 1}] (seq_offsets is [B+1]), "
                    f"got {tuple(self.num_targets.shape)}"
                )
            check_tensors(op, q, (("num_targets", self.num_targets),), floating=False)
        if int(self.max_seq_len) < 0 or int(self.contextual_len) < 0 or int(self.max_attn_len) < 0:
            raise ValueError(
                f"{op}: max_seq_len, contextual_len and max_attn_len must be >= 0, got "
                f"{self.max_seq_len}, {self.contextual_len}, {self.max_attn_len}"
            )


def check_qkv(op: str, q: Tensor, k: Tensor, v: Tensor, qk_shape: str, v_shape: str) -> None:
    """q and k of one shape ``qk_shape`` and v of ``v_shape`` (3-d, sharing the first two dims), floats
    on one device."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"{op}: q, k must be {qk_shape} and v {v_shape}; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    check_tensors(op, q, (("q", q), ("k", k), ("v", v)), floating=True)


def check_tensors(op: str, q: Tensor, named: Tuple[Tuple[str, Tensor], ...], floating: bool) -> None:
    """Each named tensor on q's device, of a floating (``floating``) or integer dtype."""
    for name, x in named:
        if x.device != q.device:
            raise ValueError(f"{op}: {name} is on {x.device}, q on {q.device}; every tensor must be on one device")
        if floating and not x.dtype.is_floating_point:
            raise TypeError(f"{op}: {name} must be a float tensor, got {x.dtype}")
        if not floating and (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool):
            raise TypeError(f"{op}: {name} must be an integer tensor, got {x.dtype}")


class AttentionWorkspace:
    """Scratch shared by the attention calls of every layer on one batch.

    A backend may keep here what depends only on the batch (its layout, masks and bias bucket
    indices: ``seq_offsets``, ``num_targets``, ``timestamps``, ``query_times`` and the layer
    config, which every layer shares), never on weights or activations, so the work is done
    once per batch instead of once per layer and again in backward. Make one per batch
    (``HSTU.forward`` does); it is bound to that batch's ``seq_offsets`` [B+1] tensor.
    """

    def __init__(self, seq_offsets: Tensor) -> None:
        self.seq_offsets = seq_offsets
        self._entries: Dict[str, Any] = {}

    def get(self, key: str, seq_offsets: Tensor, build: Callable[[], _Entry]) -> _Entry:
        """The entry ``key``, built on first use; ``seq_offsets`` must be the bound batch's."""
        if seq_offsets is not self.seq_offsets:
            raise ValueError("AttentionWorkspace: used with another batch's seq_offsets; make one per batch")
        if key not in self._entries:
            self._entries[key] = build()
        return self._entries[key]


def rebased_times(rab: RelativeBias, device: torch.device) -> Tuple[Tensor, Tensor]:
    """-> (key timestamps, query times), each [T] int64 on ``device``, seconds since the earliest of
    both (kernels then take time deltas in int32); one tensor twice when ``rab.query_times``
    is None. Requires ``rab.timestamps``."""
    assert rab.timestamps is not None  # RelativeBias: set with time_weights
    keys = rab.timestamps.to(device=device, dtype=torch.int64)
    if rab.query_times is None:
        times = keys - keys.min() if keys.numel() else keys
        return times, times
    both = torch.stack([keys, rab.query_times.to(device=device, dtype=torch.int64)])
    both = both - both.min() if both.numel() else both
    return both[0], both[1]


def time_bucket(delta_seconds: Tensor, bucketing: str, num_buckets: int) -> Tensor:
    """|dt| (any int/float shape) -> bucket index in [0, num_buckets) (int64)."""
    dt = delta_seconds.abs().to(torch.float32).clamp_(min=1.0)  # a fresh tensor: in place from here on
    if bucketing == "log":
        bucket = dt.log_().div_(TIME_BUCKET_LOG_DIV)
    else:
        bucket = dt.sqrt_()
    return bucket.long().clamp_(0, num_buckets - 1)


def position_bucket(rel_position: Tensor, num_buckets: int) -> Tensor:
    """pos_query - pos_key -> bucket index in [0, num_buckets) (int64)."""
    return rel_position.clamp(0, num_buckets - 1).long()


def hstu_visibility(
    row: Tensor,
    col: Tensor,
    length: Tensor,
    history_len: Tensor,
    contextual_len: int,
    max_attn_len: int,
) -> Tensor:
    """Whether query token ``row`` may attend to key token ``col`` of the same sequence.

    All arguments broadcast together; row/col are 0-based indices inside the sequence.
    * history: causal (a token sees itself and earlier tokens);
    * targets (index >= history_len): see all history and themselves, no other target;
    * the first ``contextual_len`` history tokens are visible to every token;
    * ``max_attn_len > 0``: the look-back over positions is at most that many.
    """
    pos_row = torch.minimum(row, history_len)
    pos_col = torch.minimum(col, history_len)
    dist = pos_row - pos_col
    seen = dist > 0
    if max_attn_len > 0:
        seen = seen & (dist <= max_attn_len)
    if contextual_len > 0:
        seen = seen | ((col < contextual_len) & (col < history_len))
    in_range = (row < length) & (col < length)
    return in_range & (seen | (row == col))


def silu_norm(position: Tensor, silu_scale: Optional[float]) -> Tensor:
    """Per-query factor applied after SiLU: silu_scale, or 1 / (position + 1) when None."""
    if silu_scale is not None:
        return torch.full_like(position, silu_scale, dtype=torch.float32)
    return 1.0 / (position.to(torch.float32) + 1.0)


@lru_cache(maxsize=16)
def time_bucket_thresholds(bucketing: str, num_buckets: int, device: torch.device) -> Tensor:
    """Where ``time_bucket`` steps up, for kernels that bucket |dt| with their own log/sqrt.

    returns: [num_buckets + 1] float32; entry b (1 <= b < num_buckets) is the smallest float32
    x >= 1 with ``time_bucket(x) >= b`` (+inf if none), entry 0 is 0 and the last is +inf.
    ``time_bucket(x)`` is then the number of entries 1..num_buckets-1 that are <= x, so a kernel
    whose log/sqrt is off by an ulp corrects its estimate by one step against this table and
    agrees with the reference exactly. Computed on ``device`` with ``time_bucket`` itself, once per
    (bucketing, num_buckets, device): kernels call it on every layer. Callers must not modify it.
    """
    finite = torch.tensor([1.0, torch.finfo(torch.float32).max], device=device).view(torch.int32).long()
    targets = torch.arange(1, num_buckets, device=device)
    lo = torch.full_like(targets, int(finite[0]))
    hi = torch.full_like(targets, int(finite[1]))
    for _ in range(32):  # binary search over the ordered bit patterns of positive floats
        mid = (lo + hi) // 2
        reached = time_bucket(mid.int().view(torch.float32), bucketing, num_buckets) >= targets
        hi = torch.where(reached, mid, hi)
        lo = torch.where(reached, lo, mid + 1)
    found = lo.int().view(torch.float32)
    found = torch.where(time_bucket(found, bucketing, num_buckets) >= targets, found, torch.inf)
    edge = torch.tensor([0.0, torch.inf], device=device)
    return torch.cat([edge[:1], found, edge[1:]])
