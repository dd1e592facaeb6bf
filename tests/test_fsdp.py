"""The HSTU stack sharded with FSDP2 next to TorchRec's sharded tables, on 2 CPU ranks (gloo).

One torchrun launch trains two runs of the same tiny recipe: FSDP2 for 2 epochs, and FSDP2
for 1 epoch resumed to 2; then a warm start from the first on data with more items (both ranks'
table shards and optimizer state filled from the run). One-rank runs in this process (FSDP2, and the replicated dense
model) are the references for the loss curve."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gr.train import train
from gr.train.checkpoint import read_meta
from gr.train.config import TrainConfig
from gr.train.memory import plan_from_config
from gr.train.run import _warm_start
from helpers.runs import RECIPE, epoch_losses, evaluate_loaded, recipe, step_losses

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = RECIPE["trainer"]["max_epochs"]
FSDP2 = ("distributed.dense_sharding", "fsdp2")
# One step with learning rates too small to move a weight by 1e-9: what the warm run holds is what it loaded.
WARM = (
    FSDP2,
    ("data.synthetic.num_items", RECIPE["data"]["synthetic"]["num_items"] + 40),
    ("trainer.max_epochs", 1),
    ("trainer.limit_train_batches", 1),
    ("optimizer.lr", 1e-12),
    ("sparse.optimizer.lr", 1e-12),
    ("warm_start.table_optimizer_state", "carry"),
)


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, warm_python):
    """{"fsdp", "resumed", "warm"}: run directories of the 2-rank runs."""
    root = tmp_path_factory.mktemp("fsdp")
    outs = {name: root / name for name in ("fsdp", "resumed", "warm")}
    runs = [
        {"config": recipe(FSDP2), "out": str(outs["fsdp"])},
        {"config": recipe(FSDP2, ("trainer.max_epochs", EPOCHS - 1)), "out": str(outs["resumed"])},
        {"config": recipe(FSDP2), "out": str(outs["resumed"]), "resume": True},
        {"config": recipe(*WARM, ("trainer.init_from", str(outs["fsdp"]))), "out": str(outs["warm"])},
    ]
    (root / "runs.json").write_text(json.dumps(runs))
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "OMP_NUM_THREADS": "1"}
    command = [str(ROOT / "tests" / "helpers" / "torchrun_runs.py"), str(root / "runs.json")]
    run = warm_python.torchrun(2, command, ROOT, env, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    return outs


def metrics(run_dir: Path):
    return json.loads((run_dir / "metrics.json").read_text())


def test_fsdp2_shards_hstu_parameters_and_their_optimizer_state_over_both_ranks(two_rank_runs):
    last = two_rank_runs["fsdp"] / "checkpoints" / "last"
    stored = dcp.FileSystemReader(str(last)).read_metadata().state_dict_metadata
    hstu = [k for k in stored if k.startswith("state_dict.model.hstu.")]
    adam = [k for k in stored if k.startswith("optimizer_states.0.state.hstu.") and k.endswith("exp_avg")]
    assert hstu and len(adam) == len(hstu)
    matrices = [k for k in hstu + adam if len(stored[k].size) == 2]
    assert len(matrices) >= 4
    for key in matrices:  # one chunk per rank: each rank holds about half of every matrix
        rows = [c.sizes[0] for c in stored[key].chunks]
        assert len(rows) == 2 and sum(rows) == stored[key].size[0] and abs(rows[0] - rows[1]) <= 1, key
    meta = read_meta(last)
    assert "optimizer_states" not in meta  # sharded, so in the DCP files, not in rank 0's meta.json


def test_plan_counts_per_rank_equal_the_sharded_run(two_rank_runs):
    """gr.train.memory's per-rank table rows and HSTU parameters equal what each rank stored."""
    config = TrainConfig.from_dict(recipe(FSDP2))
    plan = plan_from_config(config, nproc=2)
    item = next(t for t in plan.tables if t.name == "item")
    assert [p // item.dim for p in item.params_per_rank] == metrics(two_rank_runs["fsdp"])["table_rows_per_rank"][
        "item"
    ]
    stored = dcp.FileSystemReader(str(two_rank_runs["fsdp"] / "checkpoints" / "last")).read_metadata()
    per_rank = [0, 0]
    for key, value in stored.state_dict_metadata.items():
        if key.startswith("state_dict.model.hstu."):
            for rank, chunk in enumerate(value.chunks):
                per_rank[rank] += math.prod(chunk.sizes)
    assert list(plan.dense_params_per_rank) == per_rank  # the DNNs have no parameters here


def test_fsdp2_loss_curve_matches_replicated_dense_on_one_rank_and_one_rank_on_two(two_rank_runs, tmp_path):
    """data.batch_size is the global batch, so one rank takes the two ranks' steps on the same
    rows; the ranks draw other negatives and dropout masks and rank 0 logs its half's loss, so
    per-epoch losses match within noise: 5%, against a drop of ~45% per epoch here. On one
    rank, FSDP2 and the replicated (DDP) dense model compute the same losses to fp32 rounding:
    AdamW runs PyTorch's fused kernel on plain parameters and its default loop on FSDP2's
    DTensors, the same update in another order."""
    train(TrainConfig.from_dict(recipe(FSDP2)), tmp_path / "fsdp2")
    train(TrainConfig.from_dict(recipe(("trainer.max_epochs", 1))), tmp_path / "none")
    replicated = step_losses(tmp_path / "none")
    assert len(replicated) >= 2
    assert step_losses(tmp_path / "fsdp2")[: len(replicated)] == pytest.approx(replicated, rel=1e-5)
    one_rank, two_ranks = epoch_losses(tmp_path / "fsdp2"), epoch_losses(two_rank_runs["fsdp"])
    assert len(two_ranks) == EPOCHS and two_ranks[-1] < 0.7 * two_ranks[0]
    assert two_ranks == pytest.approx(one_rank, rel=0.05), (two_ranks, one_rank)


def test_fsdp2_run_resumed_from_its_dcp_checkpoint_ends_like_the_uninterrupted_one(two_rank_runs):
    uninterrupted, resumed = metrics(two_rank_runs["fsdp"]), metrics(two_rank_runs["resumed"])
    assert resumed["epochs"] == EPOCHS
    for key in ("hr@5", "ndcg@5", "hr@10", "ndcg@10", "mrr"):
        assert resumed[key] == pytest.approx(uninterrupted[key], abs=1e-6), key


def test_fsdp2_checkpoint_loads_into_a_plain_model_that_scores_like_the_run(two_rank_runs):
    """Both ranks' HSTU shards (and table shards) merge into one plain model in this process."""
    run_metrics = metrics(two_rank_runs["fsdp"])
    model, merged = evaluate_loaded(two_rank_runs["fsdp"])
    assert type(model.hstu).__name__ == "HSTU"
    assert not isinstance(model.hstu.layers[0].uvqk.weight, torch.distributed.tensor.DTensor)
    for key in ("hr@10", "ndcg@10", "mrr"):
        assert merged[key] == pytest.approx(run_metrics[key], abs=1e-6), key


def test_a_two_rank_warm_start_fills_both_ranks_table_shards_and_their_optimizer_state(two_rank_runs):
    """The warm run's item table grew (new ids appended to the run's map); its first rows and
    their RowWiseAdagrad sums are the run's, loaded into both ranks' shards."""
    old, warm = (
        _warm_start(TrainConfig.from_dict(recipe(*WARM, ("trainer.init_from", str(two_rank_runs[name])))))
        for name in ("fsdp", "warm")
    )
    old_items, items = old.maps["items"].raw, warm.maps["items"].raw
    assert len(items) > len(old_items) and items[: len(old_items)].tolist() == old_items.tolist()
    (table,) = [k for k in old.model.state_dict() if k.endswith("embeddings.item.weight")]
    before, after = old.model.state_dict()[table], warm.model.state_dict()[table]
    assert after.shape[0] == len(items)
    torch.testing.assert_close(after[: len(old_items)], before, rtol=0, atol=1e-9)
    (sums,) = [k for k in old.table_optimizer_state["state"][table] if k.endswith("momentum1")]
    sums_before, sums_after = (run.table_optimizer_state["state"][table][sums] for run in (old, warm))
    assert sums_before.abs().sum() > 0
    # carried, then one step added squared gradients: never below the run's, above it where the step touched
    assert (sums_after[: len(old_items)] >= sums_before).all()
    assert (sums_after[: len(old_items)] > sums_before).any()
