"""One HSTU layer (Zhai et al. 2024, eq. 1-3), split into steps a KV cache can reuse."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gr.hstu.config import HSTUConfig
from gr.hstu.dropout import Dropout
from gr.hstu.kernels.attention import AttentionWorkspace, RelativeBias, hstu_attention
from gr.hstu.kernels.cached_attention import CachedSetup, hstu_cached_attention
from gr.hstu.kernels.cached_attention.common import CacheTensor
from gr.hstu.kernels.layer_ops import combine, project


class HSTULayer(nn.Module):
    """``U,V,Q,K = split(SiLU(W1 LN(X)))``; ``A = SiLU(alpha QK^T + rab) * norm`` under the
    mask; ``Y = X + W2 Dropout(LN(A V) * U)``.

    Parameter names (fixed, the export format relies on them): ``input_norm.*``,
    ``uvqk.*``, ``attn_norm.*``, ``output.*``, ``position_bias`` [P], ``time_bias`` [NB].
    """

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        self.config = config
        self.attention_options = config.attention_options()
        heads, dl, da = config.num_heads, config.linear_dim, config.attention_dim
        self.input_norm = nn.LayerNorm(config.hidden_dim, eps=config.layer_norm_eps)
        self.uvqk = nn.Linear(config.hidden_dim, heads * (2 * dl + 2 * da))
        self.attn_norm = nn.LayerNorm(heads * dl, eps=config.layer_norm_eps)
        self.output = nn.Linear(heads * dl, config.hidden_dim)
        self.dropout = Dropout(config.dropout)
        nn.init.normal_(self.uvqk.weight, std=0.02)
        nn.init.zeros_(self.uvqk.bias)
        pos_buckets = config.num_position_buckets
        self.position_bias = nn.Parameter(torch.randn(pos_buckets) * 0.02) if pos_buckets > 0 else None
        self.time_bias = nn.Parameter(torch.randn(config.time_buckets) * 0.02) if config.time_buckets > 0 else None

    def project(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """x: [T, D] -> u: [T, H*Dl], q: [T, H, Da], k: [T, H, Da], v: [T, H, Dl]."""
        c = self.config
        heads, dl, da = c.num_heads, c.linear_dim, c.attention_dim
        u, v, q, k = project(x, self.input_norm, self.uvqk, [heads * dl, heads * dl, heads * da, heads * da])
        return u, q.reshape(-1, heads, da), k.reshape(-1, heads, da), v.reshape(-1, heads, dl)

    def relative_bias(
        self, timestamps: Optional[Tensor], query_times: Optional[Tensor] = None
    ) -> Optional[RelativeBias]:
        """timestamps, query_times: [T] int64 or None -> the bias parts the kernel fuses."""
        if self.position_bias is None and self.time_bias is None:
            return None
        timed = self.time_bias is not None
        next_event = timed and self.config.query_time == "next_event"
        if timed and timestamps is None:
            raise ValueError("HSTU: timestamps are required when HSTUConfig.time_buckets > 0")
        if next_event and query_times is None:
            raise ValueError(
                "HSTU: query_times (each token's next event time) are required when "
                "HSTUConfig.query_time is 'next_event'"
            )
        return RelativeBias(
            position_weights=self.position_bias,
            time_weights=self.time_bias,
            timestamps=timestamps if timed else None,
            time_bucketing=self.config.time_bucketing,
            query_times=query_times if next_event else None,
        )

    def combine(self, x: Tensor, attn: Tensor, u: Tensor) -> Tensor:
        """x: [T, D], attn: [T, H, Dl], u: [T, H*Dl] -> [T, D] (residual added)."""
        return combine(x, attn.reshape(attn.shape[0], -1), u, self.attn_norm, self.dropout, self.output)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        seq_offsets: Tensor,
        max_seq_len: int,
        timestamps: Optional[Tensor] = None,
        num_targets: Optional[Tensor] = None,
        query_times: Optional[Tensor] = None,
        workspace: Optional[AttentionWorkspace] = None,
    ) -> Tensor:
        """q, k: [T, H, Da], v: [T, H, Dl] -> [T, H, Dl]: this layer's masked, biased attention."""
        return hstu_attention(
            q,
            k,
            v,
            seq_offsets,
            max_seq_len,
            num_targets=num_targets,
            rab=self.relative_bias(timestamps, query_times),
            backend=self.config.kernel_backend,
            workspace=workspace,
            **self.attention_options.keywords(),
        )

    def attend_cached(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        new_offsets: Tensor,
        cache_k: CacheTensor,
        cache_v: CacheTensor,
        cache_offsets: Tensor,
        *,
        new_tokens: str,
        positions: Optional[Tensor] = None,
        block_visible: Optional[Tensor] = None,
        timestamps: Optional[Tensor] = None,
        query_times: Optional[Tensor] = None,
        cache_timestamps: Optional[CacheTensor] = None,
        setup: Optional[CachedSetup] = None,
    ) -> Tensor:
        """New tokens against cached K/V and themselves under this layer's mask and bias
        (``gr.hstu.kernels.cached_attention.hstu_cached_attention``; ``setup``: the pass's, shared by
        its layers): q, k: [N, H, Da], v: [N, H, Dl] -> [N, H, Dl]."""
        return hstu_cached_attention(
            q,
            k,
            v,
            new_offsets,
            cache_k,
            cache_v,
            cache_offsets,
            new_tokens=new_tokens,
            positions=positions,
            block_visible=block_visible,
            rab=self.relative_bias(timestamps, query_times),
            cache_timestamps=cache_timestamps,
            setup=setup,
            backend=self.config.kernel_backend,
            **self.attention_options.keywords(),
        )

    def forward(
        self,
        x: Tensor,
        seq_offsets: Tensor,
        max_seq_len: int,
        timestamps: Optional[Tensor] = None,
        num_targets: Optional[Tensor] = None,
        query_times: Optional[Tensor] = None,
        workspace: Optional[AttentionWorkspace] = None,
    ) -> Tensor:
        """x: [T, D] -> [T, D]; see ``HSTU.forward`` for the other arguments (``workspace``: the
        batch's ``AttentionWorkspace``, shared by the layers)."""
        args = (seq_offsets, max_seq_len, timestamps, num_targets, query_times, workspace)
        recompute = self.config.recompute if torch.is_grad_enabled() and self.training else "none"
        if recompute == "layer":
            return checkpoint(self._project_attend_combine, x, *args, use_reentrant=False)
        u, q, k, v = self.project(x)
        if recompute == "attention":
            return checkpoint(self._attend_combine, x, u, q, k, v, *args, use_reentrant=False)
        return self._attend_combine(x, u, q, k, v, *args)

    def _project_attend_combine(
        self,
        x: Tensor,
        seq_offsets: Tensor,
        max_seq_len: int,
        timestamps: Optional[Tensor],
        num_targets: Optional[Tensor],
        query_times: Optional[Tensor],
        workspace: Optional[AttentionWorkspace],
    ) -> Tensor:
        return self._attend_combine(
            x, *self.project(x), seq_offsets, max_seq_len, timestamps, num_targets, query_times, workspace
        )

    def _attend_combine(
        self,
        x: Tensor,
        u: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        seq_offsets: Tensor,
        max_seq_len: int,
        timestamps: Optional[Tensor],
        num_targets: Optional[Tensor],
        query_times: Optional[Tensor],
        workspace: Optional[AttentionWorkspace],
    ) -> Tensor:
        attn = self.attend(q, k, v, seq_offsets, max_seq_len, timestamps, num_targets, query_times, workspace)
        return self.combine(x, attn, u)
