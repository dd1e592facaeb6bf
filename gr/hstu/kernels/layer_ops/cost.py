"""Memory estimates of the HSTU layer's steps around attention: what ``gr.train.memory`` sums per layer.

Each is what one op of ``gr.hstu.kernels.layer_ops`` keeps from forward to backward, in bytes per
token, beyond its inputs that the layer keeps anyway; ``tests/test_plan.py`` holds their sum to
torch's memory profiler. ``e`` is the compute dtype's bytes (4 fp32, 2 under bf16 autocast), D the
input width, P the projection's (heads * (2 linear_dim + 2 attention_dim): U, V, Q, K) and A the
attention's (heads * linear_dim):

  ``project``:      LayerNorm stats 8 + LN(x) eD + pre-SiLU eP + SiLU eP (attention keeps q, k, v as
                    views of it, bf16 included)
  ``combine``:      attention eA + stats 8 + LN(attention) eA + dropout mask eA and output eA (or
                    the product eA without dropout)
  ``stack_input``:  its dropout mask, 4D

With gr's native CPU kernels (``gr.ops.native.fused_expected``) e = 4 in either precision (bf16
autocast runs them in bf16 math on fp32 activations); ``project`` keeps no LN(x) and ``combine`` no
output input, which backward recomputes (after the attention: 4A + stats 8 + a byte mask A); the
stack input's dropout mask is a byte mask, D.
"""

from __future__ import annotations

from gr.ops.native import fused_expected

FP32 = 4
LAYER_NORM_STATS = 2 * FP32  # mean and 1/std per token


def project_bytes(hidden_dim: int, projection_width: int, compute_bytes: int) -> int:
    """Bytes per token ``project`` keeps for backward (LayerNorm of ``hidden_dim``, projection to
    ``projection_width``) with activations of ``compute_bytes`` bytes."""
    fused = fused_expected()
    e = FP32 if fused else compute_bytes
    return LAYER_NORM_STATS + (0 if fused else e * hidden_dim) + 2 * e * projection_width


def combine_bytes(attention_width: int, dropout: float, compute_bytes: int) -> int:
    """Bytes per token ``combine`` keeps for backward (attention rows of ``attention_width``, dropout
    probability ``dropout``) with activations of ``compute_bytes`` bytes."""
    if fused_expected():
        return LAYER_NORM_STATS + FP32 * attention_width + (attention_width if dropout > 0 else 0)
    return LAYER_NORM_STATS + (4 if dropout > 0 else 3) * compute_bytes * attention_width


def stack_input_mask_bytes(hidden_dim: int) -> int:
    """Bytes per token of ``stack_input``'s dropout mask (when it drops): a byte per element from the
    native kernel, fp32 from PyTorch's dropout."""
    return hidden_dim if fused_expected() else FP32 * hidden_dim
