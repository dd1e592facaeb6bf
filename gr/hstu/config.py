"""HSTUConfig: the only way users change the framework-owned HSTU stack."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import InitVar, dataclass
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

from gr.utils.config_checks import (
    BOOL,
    PROBABILITY,
    Section,
    checked,
    int_at_least,
    known_keys,
    number_in,
    one_of,
    optional,
)

if TYPE_CHECKING:
    from gr.hstu.kernels.attention.common import AttentionOptions

ATTN_NORMS = ("max_seq_len", "seq_len")
TIME_BUCKETINGS = ("log", "sqrt")
KERNEL_BACKENDS = ("auto", "pytorch", "cpu", "triton", "ascend", "ascend_triton")
RECOMPUTE_MODES = ("none", "attention", "layer")
QUERY_TIMES = ("token", "next_event")


@dataclass(frozen=True)
class HSTUConfig(Section):
    """Hyper-parameters of the HSTU stack (Zhai et al. 2024), validated on construction.

    Attention is ``SiLU(alpha * q k^T + rab) * norm`` where ``norm`` is
    ``1 / max_seq_len`` (``attn_norm="max_seq_len"``, the paper's recipe) or
    ``1 / n_i`` with ``n_i`` the number of history tokens up to and including the
    query's position (``attn_norm="seq_len"``: each sequence's own length so far,
    which keeps cached history valid when the sequence grows).
    """

    hidden_dim: int = checked(64, int_at_least(1))
    num_layers: int = checked(2, int_at_least(1))
    num_heads: int = checked(1, int_at_least(1))
    attention_dim: int = checked(64, int_at_least(1))  # q/k size per head
    linear_dim: int = checked(64, int_at_least(1))  # v/u size per head
    max_seq_len: int = checked(200, int_at_least(1))  # longest history (targets excluded)
    # a longer history drops its oldest tokens in blocks of this many (``gr.jagged_rows.evicted_prefix``),
    # in training windows and served histories alike: a served user's cache then survives all but
    # one request per block. 1: slide by one token.
    eviction_block: int = checked(1, int_at_least(1))
    dropout: float = checked(0.2, PROBABILITY)  # on LayerNorm(AV) * U, before the output projection
    input_dropout: float = checked(0.2, PROBABILITY)  # on the input embeddings
    attn_alpha: Optional[float] = checked(
        None, optional(number_in(0.0, open_low=True))
    )  # None -> 1 / sqrt(attention_dim)
    attn_norm: str = checked("max_seq_len", one_of(*ATTN_NORMS))
    position_embedding: bool = checked(True, BOOL)  # learned absolute positions added to the input
    scale_input: bool = checked(True, BOOL)  # multiply input embeddings by sqrt(hidden_dim)
    # relative position bias; None -> max_seq_len + 1, 0 -> off
    position_buckets: Optional[int] = checked(None, optional(int_at_least(0)))
    time_buckets: int = checked(128, int_at_least(0))  # relative time bias buckets; 0 -> off
    time_bucketing: str = checked("log", one_of(*TIME_BUCKETINGS))  # how |t_query - t_key| (seconds) maps to a bucket
    # t_query of the time bias: "token", the query token's own timestamp; "next_event", the time
    # of the event the token predicts (the next token's; the request time for the last history
    # token), as in the HSTU paper's code. "next_event" needs ``query_times`` in forward.
    query_time: str = checked("token", one_of(*QUERY_TIMES))
    contextual_len: int = checked(0, int_at_least(0))  # leading tokens every token may attend to
    max_attn_len: int = checked(0, int_at_least(0))  # local look-back window in positions; 0 -> unbounded
    layer_norm_eps: float = checked(1e-6, number_in(0.0, 1.0, open_low=True, open_high=True))
    kernel_backend: str = checked("auto", one_of(*KERNEL_BACKENDS))
    # Activation recompute per layer in training: "none"; "attention" keeps the layer
    # input and its U/V/Q/K projections and recomputes attention, norm and output;
    # "layer" keeps only the layer input and recomputes everything.
    recompute: str = checked("none", one_of(*RECOMPUTE_MODES))
    where: InitVar[str] = "HSTUConfig"

    def __post_init__(self, where: str) -> None:
        self.validate(where)
        if self.eviction_block > self.max_seq_len:
            raise ValueError(f"{where}.eviction_block: {self.eviction_block} exceeds max_seq_len {self.max_seq_len}")
        if self.contextual_len > self.max_seq_len:
            raise ValueError(f"{where}.contextual_len: {self.contextual_len} exceeds max_seq_len {self.max_seq_len}")

    @property
    def alpha(self) -> float:
        return self.attn_alpha if self.attn_alpha is not None else 1.0 / math.sqrt(self.attention_dim)

    def attention_options(self) -> AttentionOptions:
        """The options of every attention call of a layer: the mask's ``contextual_len`` and
        ``max_attn_len``, ``alpha``, and the norm ``attn_norm`` picks (``silu_scale`` 1 / max_seq_len,
        or None: each sequence's own length so far)."""
        # The kernels (torch) are imported where a layer is built, never to read a config (gr train --help).
        from gr.hstu.kernels.attention.common import AttentionOptions

        silu_scale = 1.0 / self.max_seq_len if self.attn_norm == "max_seq_len" else None
        return AttentionOptions(self.contextual_len, self.max_attn_len, self.alpha, silu_scale)

    @property
    def num_position_buckets(self) -> int:
        return self.max_seq_len + 1 if self.position_buckets is None else self.position_buckets

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "HSTUConfig") -> "HSTUConfig":
        """Build from a mapping; unknown or invalid keys are an error naming ``where`` and the key."""
        return cls(**known_keys(cls, values, where), where=where)
