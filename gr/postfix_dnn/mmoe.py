"""A ready PostfixDNN for multi-task ranking: MMoE experts, one gate and tower per task."""

from __future__ import annotations

from typing import Dict, Mapping, Sequence

import torch
from torch import Tensor, nn

from gr.postfix_dnn.base import PostfixDNN
from gr.prefix_dnn.mlp_encoder import mlp


class MMoERankingHead(PostfixDNN):
    """[hidden [N, D] | common features [N, d_c]] -> experts -> per-task gate mix -> tower.

    Returns ``{task: [N] logits}``. tasks: task names (e.g. "click", "like").
    common_dims: ordered {common feature name: dim} concatenated to the hidden state.
    """

    def __init__(
        self,
        hidden_dim: int,
        tasks: Sequence[str],
        num_experts: int = 4,
        expert_dims: Sequence[int] = (128,),
        tower_dims: Sequence[int] = (64,),
        common_dims: Mapping[str, int] | None = None,
        dropout: float = 0.0,
    ):
        super().__init__()
        if not tasks:
            raise ValueError("MMoERankingHead.tasks: expected at least one task")
        if num_experts < 1 or not expert_dims:
            raise ValueError("MMoERankingHead: expected num_experts >= 1 and non-empty expert_dims")
        self.output_names = tuple(tasks)
        self.common_feature_names = tuple(common_dims or {})
        input_dim = hidden_dim + sum((common_dims or {}).values())
        self.experts = nn.ModuleList(
            nn.Sequential(mlp(input_dim, expert_dims, dropout), nn.SiLU()) for _ in range(num_experts)
        )
        self.gates = nn.ModuleDict({t: nn.Linear(input_dim, num_experts) for t in tasks})
        self.towers = nn.ModuleDict({t: mlp(expert_dims[-1], [*tower_dims, 1], dropout) for t in tasks})

    def forward(self, hidden: Tensor, common: Dict[str, Tensor]) -> Dict[str, Tensor]:
        x = torch.cat([hidden, *(common[name] for name in self.common_feature_names)], dim=-1)
        experts = torch.stack([e(x) for e in self.experts], dim=1)  # [N, E, d]
        out = {}
        for task in self.output_names:
            gate = torch.softmax(self.gates[task](x), dim=-1).unsqueeze(-1)  # [N, E, 1]
            out[task] = self.towers[task]((gate * experts).sum(1)).squeeze(-1)
        return out
