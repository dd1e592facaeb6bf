"""Model builders and request helpers shared by the export, serving and generation tests.

Tiny GRModels (a ranking model with the shipped DNNs, user-defined DNNs, retrieval and generative
models), random jagged batches for them, the serving requests of a batch, and their scores.
"""

from pathlib import Path
from typing import Dict, List

import numpy as np
import torch
from torch import Tensor, nn
from torchrec import KeyedJaggedTensor

from gr import GRInput, GRModel, HSTUConfig, PostfixDNN, PrefixDNN, TableConfig
from gr.commands.evaluate import batch_requests
from gr.data.mappings import IdMap, save_mappings
from gr.postfix_dnn import MMoERankingHead, RetrievalHead
from gr.prefix_dnn import MLPTokenEncoder
from gr.serving import Ranker

HSTU_KW = dict(
    hidden_dim=16,
    num_layers=2,
    num_heads=2,
    attention_dim=8,
    linear_dim=8,
    max_seq_len=40,
    dropout=0.0,
    input_dropout=0.0,
)
DENSE_DIMS = {"user_score": 2}


def perturb(model: nn.Module, seed: int = 0, std: float = 0.1) -> nn.Module:
    """Add noise to every parameter so biases and norms are not at their trivial init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return model.eval()


def build_ranking_model(**hstu_overrides) -> GRModel:
    """Shipped DNNs: sequence ids (item, genre) + a dense token feature in, a pooled common id
    and a dense common feature into an MMoE head with two tasks."""
    tables = [
        TableConfig("item", 50, 16, ("item_id",)),
        TableConfig("genre", 10, 4, ("genre",)),
        TableConfig("user", 20, 8, ("user_id",), kind="common", pooling="mean"),
    ]
    prefix = MLPTokenEncoder({"item_id": 16, "genre": 4, "age": 1}, 16, mlp_dims=(24,))
    postfix = MMoERankingHead(
        16,
        ["click", "like"],
        num_experts=3,
        expert_dims=(12,),
        tower_dims=(8,),
        common_dims={"user_id": 8, "user_score": 2},
    )
    return perturb(GRModel(HSTUConfig(**{**HSTU_KW, **hstu_overrides}), prefix, postfix, tables))


class GatedEncoder(PrefixDNN):
    """A user-defined PrefixDNN: gated projection of the item embedding plus a dense feature."""

    feature_names = ("item_id", "price")

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16 + 3, 16)
        self.gate = nn.Linear(3, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, features: Dict[str, Tensor]) -> Tensor:
        x = torch.cat([features["item_id"], features["price"]], dim=-1)
        return self.norm(self.proj(x) * torch.sigmoid(self.gate(features["price"])))


class ScoreAndEmbed(PostfixDNN):
    """A user-defined PostfixDNN: a [N] score and a [N, 4] embedding, with a dense common feature."""

    common_feature_names = ("context",)
    output_names = ("score", "embedding")

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Sequential(nn.Linear(16 + 5, 8), nn.GELU(), nn.Linear(8, 1))
        self.embed = nn.Linear(16, 4)

    def forward(self, hidden: Tensor, common: Dict[str, Tensor]) -> Dict[str, Tensor]:
        x = torch.cat([hidden, common["context"]], dim=-1)
        return {"score": self.score(x).squeeze(-1), "embedding": torch.tanh(self.embed(hidden))}


def build_custom_model() -> GRModel:
    tables = [TableConfig("item", 50, 16, ("item_id",))]
    cfg = HSTUConfig(**{**HSTU_KW, "num_heads": 1, "attn_norm": "seq_len", "contextual_len": 2, "max_attn_len": 9})
    return perturb(GRModel(cfg, GatedEncoder(), ScoreAndEmbed(), tables), seed=1)


def build_retrieval_model() -> GRModel:
    """The HSTU paper's retrieval setting: identity PrefixDNN, normalising head, no common features."""
    tables = [TableConfig("item", 50, 16, ("item_id",))]
    cfg = HSTUConfig(**{**HSTU_KW, "time_buckets": 0})
    return perturb(GRModel(cfg, MLPTokenEncoder({"item_id": 16}, 16), RetrievalHead(16, 16), tables), seed=2)


def random_batch(model: GRModel, lengths: List[int], num_targets: List[int], seed: int = 0) -> GRInput:
    """A jagged ranking batch for ``model``'s features: sorted history timestamps, candidates at
    one later request time (each sequence needs one or more); ids drawn from each feature's table."""
    g = torch.Generator().manual_seed(seed)
    tables = model.embeddings.tables.values()
    seq_tables = {f: t.num_embeddings for t in tables if t.kind == "sequence" for f in t.features}
    common_tables = {f: t.num_embeddings for t in tables if t.kind == "common" for f in t.features}
    lengths_t = torch.tensor(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths_t.cumsum(0)])
    total = int(offsets[-1])
    ts, query_ts = [], []
    for n, k in zip(lengths, num_targets):
        hist = torch.sort(torch.randint(0, 10**6, (n - k,), generator=g)).values
        request = torch.full((k,), 10**6 + int(torch.randint(0, 5000, (1,), generator=g)))
        ts += [hist, request]
        query_ts += [torch.cat([hist, request[:1]])[1:], request]  # the next event's time (the request's)
    token_names = [f for f in model.prefix_dnn.feature_names if f in seq_tables]
    seq_ids = KeyedJaggedTensor.from_lengths_sync(
        token_names,
        torch.cat([torch.randint(0, seq_tables[f], (total,), generator=g) for f in token_names]),
        torch.cat([lengths_t] * len(token_names)),
    )
    token_dense = {f: torch.randn(total, dim, generator=g) for f, dim in _dense(model.prefix_dnn, seq_tables).items()}
    common_names = [f for f in model.postfix_dnn.common_feature_names if f in common_tables]
    bags = [1 + int(torch.randint(0, 3, (1,), generator=g)) for _ in lengths]
    common_ids = None
    if common_names:
        ids = [torch.randint(0, common_tables[f], (sum(bags),), generator=g) for f in common_names]
        bag_lengths = torch.tensor(bags * len(common_names))
        common_ids = KeyedJaggedTensor.from_lengths_sync(common_names, torch.cat(ids), bag_lengths)
    common_dense = {
        f: torch.randn(len(lengths), dim, generator=g) for f, dim in _dense(model.postfix_dnn, common_tables).items()
    }
    return GRInput(
        seq_offsets=offsets,
        max_seq_len=max(lengths),
        timestamps=torch.cat(ts),
        num_targets=torch.tensor(num_targets),
        sequence_ids=seq_ids,
        token_dense=token_dense,
        common_ids=common_ids,
        common_dense=common_dense,
        query_times=torch.cat(query_ts),
    )


def _dense(module: nn.Module, tables: Dict[str, int]) -> Dict[str, int]:
    dims = {"age": 1, "price": 3, "user_score": 2, "context": 5}
    names = getattr(module, "feature_names", None) or module.common_feature_names
    return {f: dims[f] for f in names if f not in tables}


def requests_from_batch(batch: GRInput) -> List[dict]:
    """One serving request per sequence of ``batch`` (history = non-target tokens), users "user{b}"."""
    return batch_requests(batch)


def as_served(predictions: Dict[str, object]) -> Dict[str, np.ndarray]:
    """A ranking model's trained predictions {task: [N] logits} as serving names them: the
    probability 1 / (1 + exp(-logit)) under the task, the logit under ``<task>_logit``."""
    out = {}
    for task, value in predictions.items():
        logit = np.asarray(value, dtype=np.float64)
        out[task] = 1.0 / (1.0 + np.exp(-logit))
        out[f"{task}_logit"] = logit
    return out


def rank_all(ranker: Ranker, requests: List[dict], **kwargs) -> Dict[str, np.ndarray]:
    """Scores of every request, concatenated per task in request order."""
    results = [
        ranker.rank(r["user_id"], r["history"], r["candidates"], r["common_features"], **kwargs) for r in requests
    ]
    return {task: np.concatenate([res.scores[task] for res in results]) for task in results[0].scores}


def write_id_mappings(directory: Path) -> Path:
    """A mappings directory as ``SequenceDataModule.save_mappings`` writes it (items and one feature)."""
    save_mappings(str(directory), {"items": IdMap(np.array([1001])), "genre": IdMap(np.array(["drama"]))}, {})
    return directory


NUM_ITEMS = 50


def build_generative_model(num_layers: int, seed: int) -> GRModel:
    """Retrieval with a time bias, an MLP PrefixDNN and an MLP retrieval head."""
    torch.manual_seed(seed)
    tables = [TableConfig("item", NUM_ITEMS, 16, ("item_id",))]
    cfg = HSTUConfig(**{**HSTU_KW, "num_layers": num_layers})
    return perturb(
        GRModel(
            cfg, MLPTokenEncoder({"item_id": 16}, 16, mlp_dims=(24,)), RetrievalHead(16, 16, mlp_dims=(20,)), tables
        ),
        seed=seed,
    )


def users(count: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for u in range(count):
        length = 6 + u % 5
        items = torch.randperm(NUM_ITEMS, generator=g)[:length].numpy()
        ts = np.sort(torch.randint(0, 10**6, (length,), generator=g).numpy())
        out.append((f"u{u}", {"item_id": items, "timestamps": ts}))
    return out
