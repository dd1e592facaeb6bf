"""HSTUConfig: the only way users change the framework-owned HSTU stack."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

ATTN_NORMS = ("max_seq_len", "seq_len")
TIME_BUCKETINGS = ("log", "sqrt")
KERNEL_BACKENDS = ("auto", "pytorch", "cpu", "triton", "ascend", "ascend_triton")
RECOMPUTE_MODES = ("none", "attention", "layer")
QUERY_TIMES = ("token", "next_event")


@dataclass(frozen=True)
class HSTUConfig:
    """Hyper-parameters of the HSTU stack (Zhai et al. 2024), validated on construction.

    Attention is ``SiLU(alpha * q k^T + rab) * norm`` where ``norm`` is
    ``1 / max_seq_len`` (``attn_norm="max_seq_len"``, the paper's recipe) or
    ``1 / n_i`` with ``n_i`` the number of history tokens up to and including the
    query's position (``attn_norm="seq_len"``: each sequence's own length so far,
    which keeps cached history valid when the sequence grows).
    """

    hidden_dim: int = 64
    num_layers: int = 2
    num_heads: int = 1
    attention_dim: int = 64  # q/k size per head
    linear_dim: int = 64  # v/u size per head
    max_seq_len: int = 200  # longest history (targets excluded)
    dropout: float = 0.2  # on LayerNorm(AV) * U, before the output projection
    input_dropout: float = 0.2  # on the input embeddings
    attn_alpha: Optional[float] = None  # None -> 1 / sqrt(attention_dim)
    attn_norm: str = "max_seq_len"
    position_embedding: bool = True  # learned absolute positions added to the input
    scale_input: bool = True  # multiply input embeddings by sqrt(hidden_dim)
    position_buckets: Optional[int] = None  # relative position bias; None -> max_seq_len + 1, 0 -> off
    time_buckets: int = 128  # relative time bias buckets; 0 -> off
    time_bucketing: str = "log"  # how |t_query - t_key| (seconds) maps to a bucket
    # t_query of the time bias: "token", the query token's own timestamp; "next_event", the time
    # of the event the token predicts (the next token's; the request time for the last history
    # token), as in the HSTU paper's code. "next_event" needs ``query_times`` in forward.
    query_time: str = "token"
    contextual_len: int = 0  # leading tokens every token may attend to
    max_attn_len: int = 0  # local look-back window in positions; 0 -> unbounded
    layer_norm_eps: float = 1e-6
    kernel_backend: str = "auto"
    # Activation recompute per layer in training: "none"; "attention" keeps the layer
    # input and its U/V/Q/K projections and recomputes attention, norm and output;
    # "layer" keeps only the layer input and recomputes everything.
    recompute: str = "none"

    def __post_init__(self) -> None:
        for name in ("hidden_dim", "num_layers", "num_heads", "attention_dim", "linear_dim", "max_seq_len"):
            _check_int(self, name, minimum=1)
        for name in ("time_buckets", "contextual_len", "max_attn_len"):
            _check_int(self, name, minimum=0)
        if self.position_buckets is not None:
            _check_int(self, "position_buckets", minimum=0)
        for name in ("dropout", "input_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"HSTUConfig.{name}: expected a probability in [0, 1), got {value!r}")
        if self.attn_alpha is not None and (
            isinstance(self.attn_alpha, bool)
            or not isinstance(self.attn_alpha, (int, float))
            or not math.isfinite(self.attn_alpha)
            or self.attn_alpha <= 0
        ):
            raise ValueError(f"HSTUConfig.attn_alpha: expected a positive number or null, got {self.attn_alpha!r}")
        if not isinstance(self.layer_norm_eps, (int, float)) or not 0 < self.layer_norm_eps < 1:
            raise ValueError(f"HSTUConfig.layer_norm_eps: expected a small positive number, got {self.layer_norm_eps!r}")
        _check_choice(self, "attn_norm", ATTN_NORMS)
        _check_choice(self, "time_bucketing", TIME_BUCKETINGS)
        _check_choice(self, "kernel_backend", KERNEL_BACKENDS)
        _check_choice(self, "recompute", RECOMPUTE_MODES)
        _check_choice(self, "query_time", QUERY_TIMES)
        for name in ("position_embedding", "scale_input"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"HSTUConfig.{name}: expected true or false, got {getattr(self, name)!r}")
        if self.contextual_len > self.max_seq_len:
            raise ValueError(
                f"HSTUConfig.contextual_len: {self.contextual_len} exceeds max_seq_len {self.max_seq_len}"
            )

    @property
    def alpha(self) -> float:
        return self.attn_alpha if self.attn_alpha is not None else 1.0 / math.sqrt(self.attention_dim)

    @property
    def num_position_buckets(self) -> int:
        return self.max_seq_len + 1 if self.position_buckets is None else self.position_buckets

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], where: str = "HSTUConfig") -> "HSTUConfig":
        """Build from a mapping; unknown keys are an error naming ``where`` and the key."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(known)}")
        return cls(**dict(values))


def _check_int(config: HSTUConfig, name: str, minimum: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"HSTUConfig.{name}: expected an int >= {minimum}, got {value!r}")


def _check_choice(config: HSTUConfig, name: str, choices: tuple) -> None:
    value = getattr(config, name)
    if value not in choices:
        raise ValueError(f"HSTUConfig.{name}: expected one of {list(choices)}, got {value!r}")
