"""A generative model built from an HSTU and an item table, and random users for it (shared by the
decoding, relaxed-verification and item-index tests)."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from gr.generation.decoding import start
from gr.hstu import HSTU, HSTUConfig
from gr.hstu.cache import CachedHSTU

NUM_ITEMS, DIM = 60, 16


@dataclass
class TableModel:
    """A generative model from an HSTU and an item table: token = table row, query = normalised output."""

    engine: CachedHSTU
    table: Tensor

    def item_tokens(self, items: Tensor) -> Tensor:
        return self.table[items]

    def queries(self, hidden: Tensor) -> Tensor:
        return F.normalize(hidden, dim=-1)


def make_model(num_layers: int = 2, seed: int = 0, **overrides) -> TableModel:
    torch.manual_seed(seed)
    cfg = HSTUConfig(
        **{
            **dict(
                hidden_dim=DIM,
                num_layers=num_layers,
                num_heads=2,
                attention_dim=8,
                linear_dim=8,
                max_seq_len=64,
                dropout=0.0,
                input_dropout=0.0,
            ),
            **overrides,
        }
    )
    hstu = HSTU(cfg)
    with torch.no_grad():
        for p in hstu.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return TableModel(CachedHSTU(hstu), torch.randn(NUM_ITEMS, DIM))


def random_user(seed: int, length: int = 12):
    g = torch.Generator().manual_seed(seed)
    items = torch.randperm(NUM_ITEMS, generator=g)[:length]
    timestamps = torch.sort(torch.randint(0, 10**6, (length,), generator=g)).values
    return items, timestamps


REQUEST_TIME = 2 * 10**6


def begin(model, items, ts):
    """The decode state after a user's history, generating at REQUEST_TIME."""
    return start(model, items, ts, REQUEST_TIME)
