"""``sparse.backend: torch``: plain torch tables and optimizers that match TorchRec's (same initial
weights, same FBGEMM update rules, same state-dict and optimizer-state layout), trained on one
rank, resumed across backends, and trained, exported and served in a process without TorchRec."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from gr.data.features import FeatureSpec
from gr.sparse import EmbeddingOptimizerConfig, SparseEmbeddings, TableConfig
from gr.sparse.keyed_jagged import KeyedJaggedTensor
from gr.sparse.row_optimizers import RowOptimizer
from gr.sparse.sharding import check_one_rank
from gr.sparse.torch_tables import prepare_for_training
from gr.train import train
from gr.train.build import seeded_model
from gr.train.config import TrainConfig
from helpers.runs import RANKING, config, step_losses, with_overrides

ROOT = Path(__file__).resolve().parents[1]
# Largest difference of a logged training loss between the backends over 20 steps of the tiny
# ranking recipe (measured: 6e-8; float rounding of the same computation in another order).
LOSS_TOLERANCE = 1e-5
# The tiny ranking recipe (item, category and pooled user tables), 5 steps an epoch.
STEPS = ("trainer.limit_train_batches", 5)
TABLES = [
    TableConfig("item", 30, 14, ("item_id", "other_item")),  # stored 16 wide
    TableConfig("genre", 7, 8, ("genre",)),
    TableConfig("user", 5, 6, ("user_age", "user_city"), kind="common"),
    TableConfig("group", 9, 4, ("user_group",), kind="common", pooling="mean"),
    TableConfig("tag", 8, 4, ("tags",), kind="token_bag", pooling="mean"),  # a list-valued token feature
]


class Tables(nn.Module):
    def __init__(self, backend: str, dedup: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embeddings = SparseEmbeddings(TABLES, dedup=dedup, backend=backend)

    def forward(self, sequence_ids, common_ids, token_lists=None):
        return self.embeddings(sequence_ids, common_ids, token_lists)


def ids(step: int):
    """Sequence ids (3 samples, repeats within and across features), common ids (some samples
    empty) and a bag of tags per token (some empty)."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.tensor([5, 3, 4])
    sequence = torch.cat([torch.randint(0, 30, (12,), generator=g), torch.randint(0, 7, (12,), generator=g)])
    sequence = torch.cat([sequence, torch.randint(0, 30, (12,), generator=g)])
    common_lengths = torch.tensor([1, 2, 0, 1, 1, 1, 2, 3, 1])
    common = torch.randint(0, 5, (int(common_lengths.sum()),), generator=g)
    bag_lengths = torch.randint(0, 4, (int(lengths.sum()),), generator=g)
    bags = torch.randint(0, 8, (int(bag_lengths.sum()),), generator=g)
    return (
        KeyedJaggedTensor(["item_id", "genre", "other_item"], sequence, lengths.repeat(3)),
        KeyedJaggedTensor(["user_age", "user_city", "user_group"], common, common_lengths),
        KeyedJaggedTensor(["tags"], bags, bag_lengths),
    )


def local(value):
    return value.local_shards()[0].tensor if hasattr(value, "local_shards") else value


@pytest.mark.parametrize(
    "kind, dedup", [("sgd", False), ("adagrad", True), ("rowwise_adagrad", False), ("rowwise_adagrad", True)]
)
def test_torch_tables_train_like_torchrec_fused_kernels(process_group, kind, dedup):
    """The optimizers FBGEMM fuses on CPU, five steps on the same lookups (repeated ids, padded
    rows, sum and mean pooling per request and per token; TorchRec without dedup): same weights,
    same optimizer state under the same names and shapes."""
    from gr.sparse.sharding import shard_model

    optimizer = EmbeddingOptimizerConfig(kind, lr=0.3)
    torchrec = shard_model(Tables("torchrec"), optimizer, torch.device("cpu"))
    plain = Tables("torch", dedup)
    optimizers = prepare_for_training(plain, optimizer, torch.device("cpu"))
    for step in range(5):
        for model in (torchrec, plain):
            sequence, common = model(*ids(step))
            g = torch.Generator().manual_seed(100 + step)
            outputs = [v for _, v in sorted({**sequence, **common}.items())]
            sum((v * torch.randn(v.shape, generator=g)).sum() for v in outputs).backward()
    assert all(p.grad is None for p in plain.parameters())  # updated inside backward, like the fused kernels
    want, got = torchrec.state_dict(), plain.state_dict()
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], local(want[key]), rtol=0, atol=1e-6, msg=key)
    want, got = torchrec.fused_optimizer.state_dict()["state"], optimizers.state_dict()["state"]
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in want.items()}
    for weight, states in want.items():
        for name, value in states.items():
            torch.testing.assert_close(got[weight][name], local(value), rtol=0, atol=1e-5, msg=name)


def test_row_wise_adagrad_weight_decay_on_sequence_tables_matches_torchrec(process_group):
    from gr.sparse.sharding import shard_model

    optimizer = EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.3, weight_decay=0.1)
    torchrec = shard_model(Tables("torchrec"), optimizer, torch.device("cpu"))
    plain = Tables("torch")
    prepare_for_training(plain, optimizer, torch.device("cpu"))
    for step in range(3):
        for model in (torchrec, plain):
            sum(v.sum() for v in model(ids(step)[0], None)[0].values()).backward()
    for key, value in torchrec.state_dict().items():
        if ".sequence." in key:
            torch.testing.assert_close(plain.state_dict()[key], local(value), rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("kind", ["adam", "partial_rowwise_adam"])
def test_adam_rules_on_rows_looked_up_every_step_are_adamw(kind):
    """Every row looked up once a step: FBGEMM's Adam is AdamW; the partial row-wise variant is
    AdamW with one second moment per row, the mean of the squared gradient's row."""
    weight = torch.randn(6, 4)
    reference = nn.Parameter(weight.clone())
    optimizer = RowOptimizer(EmbeddingOptimizerConfig(kind, lr=0.1, betas=(0.8, 0.9), weight_decay=0.1), weight)
    adamw = torch.optim.AdamW([reference], lr=0.1, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1)
    m1 = torch.zeros(6, 4)
    m2 = torch.zeros(6, 1)
    for step in range(1, 4):
        grad = torch.randn(6, 4)
        optimizer.update(torch.tensor([5, 3, 1, 0, 2, 4]), grad[[5, 3, 1, 0, 2, 4]])
        if kind == "adam":
            reference.grad = grad
            adamw.step()
            continue
        m1 = 0.8 * m1 + 0.2 * grad
        m2 = 0.9 * m2 + 0.1 * grad.square().mean(1, keepdim=True)
        direction = m1 / (1 - 0.8**step) / ((m2 / (1 - 0.9**step)).sqrt() + 1e-8)
        reference.data -= 0.1 * (direction + 0.1 * reference.data)
    torch.testing.assert_close(weight, reference.detach())
    assert optimizer.state["exp_avg_sq"].shape == ((6, 4) if kind == "adam" else (6,))


def test_both_backends_build_the_same_seeded_model():
    spec = FeatureSpec(sequence={"item_id": 100, "item_category": 13}, common={"user_age": 8, "user_gender": 3})
    torchrec = seeded_model(config(RANKING), spec, ["watch"]).state_dict()
    plain = seeded_model(config(RANKING, ("sparse.backend", "torch")), spec, ["watch"])
    assert plain.embeddings.backend == "torch"
    assert list(plain.state_dict()) == list(torchrec)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, torchrec[key]), key


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{backend: metrics.json} of the tiny ranking recipe trained 4 epochs of 5 steps with it."""
    out = {}
    for backend in ("torchrec", "torch"):
        run = tmp_path_factory.mktemp(backend)
        out[backend] = train(config(RANKING, ("sparse.backend", backend), ("trainer.max_epochs", 4), STEPS), run)
        out[backend]["losses"] = step_losses(run)
    return out


def test_backends_give_the_same_losses_for_20_steps(runs):
    torchrec, plain = runs["torchrec"]["losses"], runs["torch"]["losses"]
    assert len(plain) == len(torchrec) == 20
    np.testing.assert_allclose(plain, torchrec, rtol=0, atol=LOSS_TOLERANCE)
    assert runs["torch"]["config"]["sparse"]["backend"] == "torch"
    assert runs["torch"]["table_rows_per_rank"] == {"item": [100], "category": [13], "age": [8], "gender": [3]}
    assert runs["torch"]["auc"] == pytest.approx(runs["torchrec"]["auc"], abs=1e-5)


@pytest.mark.parametrize("first, then", [("torch", "torchrec"), ("torchrec", "torch")])
def test_a_checkpoint_resumes_under_the_other_backend(runs, tmp_path, first, then):
    """Two epochs with one backend, two more with the other: the run of four with the first."""
    train(config(RANKING, ("sparse.backend", first), ("trainer.max_epochs", 2), STEPS), tmp_path)
    resumed = train(config(RANKING, ("sparse.backend", then), ("trainer.max_epochs", 4), STEPS), tmp_path, resume=True)
    assert resumed["epochs"] == 4
    for key in ("auc", "logloss"):
        assert resumed[key] == pytest.approx(runs[first][key], abs=1e-6), key


def test_more_than_one_rank_is_refused_by_the_torch_backend():
    message = r"sparse.backend: 'torch' trains on one rank; got trainer.devices 2"
    with pytest.raises(ValueError, match=message):
        config(RANKING, ("sparse.backend", "torch"), ("trainer.devices", 2))
    with pytest.raises(ValueError, match=r"sparse.backend: 'torch' trains on one rank.*'fsdp2'"):
        config(RANKING, ("sparse.backend", "torch"), ("distributed.dense_sharding", "fsdp2"))
    with pytest.raises(ValueError, match=r"sparse.backend: 'torch' keeps every table whole on one rank, but this run"):
        check_one_rank("torch", 2)  # torchrun with trainer.devices: auto: checked when the model is built
    check_one_rank("torchrec", 2)
    with pytest.raises(ValueError, match=r"sparse.backend: expected one of \['torchrec', 'torch'\]"):
        config(RANKING, ("sparse.backend", "jax"))


WITHOUT_TORCHREC = r"""
import importlib.abc, json, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torchrec", "fbgemm_gpu"):
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, Refuse())
import numpy as np, torch
from gr.data.datamodule import SequenceDataModule
from gr.commands.evaluate import batch_requests
from gr.commands.export import main as export_main
from gr.serving import Ranker
from gr.sparse import SparseEmbeddings, TableConfig
from gr.train import load_trained_model, train
from gr.train.config import TrainConfig

run, export = sys.argv[1], sys.argv[2]
metrics = train(TrainConfig.from_dict(json.loads(sys.argv[3])), run)
assert export_main([run, export]) == 0
model, config = load_trained_model(run)
data = SequenceDataModule(config.data)
data.setup()
batch = next(iter(data.test_dataloader()))
with torch.no_grad():
    logits = model(batch).predictions["watch"]
ranker = Ranker.load(export)
requests = batch_requests(batch)[:8]
served = [ranker.rank(r["user_id"], r["history"], r["candidates"], r["common_features"]) for r in requests]
served = np.concatenate([s.scores["watch_logit"] for s in served])
loaded = [m for m in sys.modules if m.partition(".")[0] in ("torchrec", "fbgemm_gpu")]
try:
    SparseEmbeddings([TableConfig("item", 4, 4, ("item_id",))])  # the default backend: TorchRec
except ImportError as error:
    refusal = str(error)
difference = float(np.abs(served - logits[: served.size].numpy()).max())
print(json.dumps({"auc": metrics["auc"], "largest_difference": difference, "imported": loaded, "refusal": refusal}))
"""


@pytest.mark.slow
def test_torch_backend_trains_exports_and_serves_where_torchrec_cannot_be_imported(tmp_path):
    recipe = with_overrides(RANKING, ("sparse.backend", "torch"), ("trainer.max_epochs", 1))
    TrainConfig.from_dict(json.loads(json.dumps(recipe)))
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    run, export = str(tmp_path / "run"), str(tmp_path / "export")
    command = [sys.executable, "-c", WITHOUT_TORCHREC, run, export, json.dumps(recipe)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["imported"] == []
    assert 0.0 <= result["auc"] <= 1.0
    assert result["largest_difference"] < 1e-4
    assert result["refusal"].startswith("sparse.backend: 'torchrec' needs TorchRec and fbgemm-gpu, which do not import")


def test_weight_decay_that_fbgemm_would_drop_is_refused():
    """FBGEMM's sgd and adagrad take no weight decay (TorchRec dropped it silently); neither backend applies it."""
    with pytest.raises(ValueError, match=r"sparse.optimizer.weight_decay: FBGEMM's adagrad takes no weight decay"):
        config(RANKING, ("sparse.optimizer.type", "adagrad"), ("sparse.optimizer.weight_decay", 0.1))


def test_keyed_jagged_tensor_reads_like_torchrecs():
    import torchrec

    keys, values, lengths = ["a", "b"], torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([2, 0, 1, 1, 2, 0])
    ours, theirs = KeyedJaggedTensor(keys, values, lengths), torchrec.KeyedJaggedTensor(keys, values, lengths=lengths)
    assert ours.stride() == theirs.stride() == 3 and ours.length_per_key() == theirs.length_per_key() == [3, 3]
    mine, want = ours.to_dict(), theirs.to_dict()
    for key in keys:
        for part in ("values", "lengths", "offsets"):
            assert torch.equal(getattr(mine[key], part)(), getattr(want[key], part)()), (key, part)
    again = KeyedJaggedTensor.from_jt_dict(mine)
    assert again.keys() == keys and torch.equal(again.values(), values) and torch.equal(again.lengths(), lengths)
    with pytest.raises(ValueError, match="5 lengths do not split into 2 keys"):
        KeyedJaggedTensor(keys, values, lengths[:5])
