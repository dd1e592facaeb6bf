"""The HSTU stack: framework-owned, configured only through ``HSTUConfig``."""

from __future__ import annotations

import math
from typing import Optional

from torch import Tensor, nn

from gr.hstu.config import HSTUConfig
from gr.hstu.dropout import Dropout
from gr.hstu.kernels.attention import AttentionWorkspace
from gr.hstu.kernels.layer_ops import stack_input
from gr.hstu.layer import HSTULayer
from gr.jagged import token_positions, validate_jagged


class HSTU(nn.Module):
    """Input embeddings (scaled, plus learned positions, dropout) -> ``num_layers`` HSTU layers.

    Parameter names: ``position_embedding.weight`` [max_seq_len + 1, D] (when on) and
    ``layers.{i}.*`` (see ``HSTULayer``). Subclassing is refused: HSTU is fixed so
    that it can have fused kernels and serving caches; the one exception is the class
    FSDP2's ``fully_shard`` derives to shard the stack (``FSDPHSTU``: FSDPModule + HSTU).
    """

    def __init_subclass__(cls, **kwargs: object) -> None:
        from torch.distributed.fsdp import FSDPModule  # only when a subclass is made: serving never pays for it

        if cls.__bases__ == (FSDPModule, HSTU):
            super().__init_subclass__(**kwargs)
            return
        raise TypeError(
            f"{cls.__name__}: HSTU is owned by the framework and cannot be subclassed; "
            "change it through HSTUConfig, and put custom logic in PrefixDNN/PostfixDNN"
        )

    def __init__(self, config: HSTUConfig) -> None:
        super().__init__()
        if not isinstance(config, HSTUConfig):
            raise TypeError(f"HSTU: expected an HSTUConfig, got {type(config).__name__}")
        self.config = config
        self.position_embedding = (
            nn.Embedding(config.max_seq_len + 1, config.hidden_dim) if config.position_embedding else None
        )
        if self.position_embedding is not None:
            nn.init.trunc_normal_(self.position_embedding.weight, std=math.sqrt(1.0 / config.hidden_dim))
        self.input_dropout = Dropout(config.input_dropout)
        self.layers = nn.ModuleList(HSTULayer(config) for _ in range(config.num_layers))

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: [T, D] token embeddings, positions: [T] int64 -> [T, D] first-layer input."""
        scale = math.sqrt(self.config.hidden_dim) if self.config.scale_input else 1.0
        if self.position_embedding is None:
            return self.input_dropout(x * scale if self.config.scale_input else x)
        rows = positions.clamp(max=self.config.max_seq_len)
        return stack_input(x, scale, self.position_embedding.weight, rows, self.input_dropout)

    def forward(
        self,
        x: Tensor,
        seq_offsets: Tensor,
        max_seq_len: int,
        timestamps: Optional[Tensor] = None,
        num_targets: Optional[Tensor] = None,
        query_times: Optional[Tensor] = None,
    ) -> Tensor:
        """Run the stack over a jagged batch.

        x: [T, D] float, PrefixDNN output
        seq_offsets: [B+1] int64
        max_seq_len: int, >= the longest sequence (targets included)
        timestamps: [T] int64 seconds (needed when the time bias is on)
        num_targets: [B] int64 or None: trailing candidate tokens per sequence
        query_times: [T] int64 seconds, when ``HSTUConfig.query_time`` is "next_event":
            the time of the event each token predicts (see ``GRInput.query_times``)
        returns: [T, D]
        """
        validate_jagged(x, seq_offsets, max_seq_len, num_targets, timestamps, query_times)
        if x.shape[-1] != self.config.hidden_dim:
            raise ValueError(f"HSTU: input has dim {x.shape[-1]}, HSTUConfig.hidden_dim is {self.config.hidden_dim}")
        positions = token_positions(seq_offsets, num_targets)
        if positions.numel() and int(positions.max()) > self.config.max_seq_len:
            raise ValueError(
                f"HSTU: a history has {int(positions.max())} tokens, HSTUConfig.max_seq_len is "
                f"{self.config.max_seq_len}; truncate histories to the most recent max_seq_len items"
            )
        h = self.embed(x, positions)
        workspace = AttentionWorkspace(seq_offsets)
        for layer in self.layers:
            h = layer(h, seq_offsets, max_seq_len, timestamps, num_targets, query_times, workspace)
        return h
