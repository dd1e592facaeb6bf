"""Sharding with TorchRec on one rank: planner constraints, optimizers fused in backward, placement.

(The 2-rank case runs in tests/test_train_torchrun.py.)
"""

import dataclasses

import pytest
import torch
from torchrec import KeyedJaggedTensor
from torchrec.optim.optimizers import in_backward_optimizer_filter

from gr import GRInput, GRModel, HSTUConfig, TableConfig
from gr.postfix_dnn import MMoERankingHead
from gr.prefix_dnn import MLPTokenEncoder
from gr.sparse.optimizer import EmbeddingOptimizerConfig
from gr.sparse.sharding import local_table_rows, shard_model, table_device

HSTU = HSTUConfig(
    hidden_dim=16, attention_dim=8, linear_dim=8, num_heads=2, max_seq_len=16, dropout=0.0, input_dropout=0.0
)


def model(tables=None):
    torch.manual_seed(0)
    tables = tables or [
        TableConfig("item", 40, 16, ("item_id",)),
        TableConfig("user", 6, 8, ("user_id",), kind="common"),
    ]
    prefix = MLPTokenEncoder({"item_id": 16}, 16)
    postfix = MMoERankingHead(
        16, ["click"], num_experts=2, expert_dims=(8,), tower_dims=(4,), common_dims={"user_id": 8}
    )
    return GRModel(HSTU, prefix, postfix, tables)


def batch():
    lengths = torch.tensor([4, 3])
    ids = KeyedJaggedTensor.from_lengths_sync(["item_id"], torch.tensor([1, 2, 3, 1, 5, 6, 2]), lengths)
    users = KeyedJaggedTensor.from_lengths_sync(["user_id"], torch.tensor([0, 4]), torch.ones(2, dtype=torch.long))
    return GRInput(torch.tensor([0, 4, 7]), 4, torch.arange(7) * 10, torch.tensor([1, 1]), ids, common_ids=users)


def test_tables_are_sharded_by_plan_and_updated_inside_backward(process_group):
    gr_model = model()
    initial = gr_model.embeddings.table_weight("item").detach().clone()
    dmp = shard_model(gr_model, EmbeddingOptimizerConfig("rowwise_adagrad", lr=0.5), torch.device("cpu"))
    plan = dmp.plan.plan
    assert plan["embeddings.sequence.dim16"]["item"].sharding_type == "row_wise"
    assert plan["embeddings.common"]["user"].sharding_type == "table_wise"
    assert local_table_rows(dmp) == {"item": 40, "user": 6}
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    assert not any("embeddings." in name for name in dense) and "hstu.layers.0.uvqk.weight" in dense
    # The sharded tables hold the unsharded model's initial rows.
    torch.testing.assert_close(
        dmp.state_dict()["embeddings.sequence.dim16.embeddings.item.weight"].local_shards()[0].tensor, initial
    )

    dmp(batch()).predictions["click"].sum().backward()  # no optimizer.step(): the kernel updates rows itself
    after = dmp.state_dict()["embeddings.sequence.dim16.embeddings.item.weight"].local_shards()[0].tensor
    looked_up = torch.tensor([1, 2, 3, 5, 6])
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[looked_up] = False
    assert not torch.allclose(after[looked_up], initial[looked_up])
    torch.testing.assert_close(after[untouched], initial[untouched])


def test_optimizer_without_a_fused_cpu_kernel_is_refused(process_group):
    with pytest.raises(ValueError, match=r"sparse.optimizer.type: 'adam' has no fused embedding kernel on cpu"):
        shard_model(model(), EmbeddingOptimizerConfig("adam"), torch.device("cpu"))
    tables = [
        TableConfig("item", 40, 16, ("item_id",), optimizer=EmbeddingOptimizerConfig("partial_rowwise_adam")),
        TableConfig("user", 6, 8, ("user_id",), kind="common"),
    ]
    with pytest.raises(ValueError, match=r"model.tables\[item\].optimizer.type"):
        shard_model(model(tables), EmbeddingOptimizerConfig(), torch.device("cpu"))


def test_sharding_type_torchrec_lacks_on_the_device_is_refused(process_group):
    tables = [
        TableConfig("item", 40, 16, ("item_id",)),
        TableConfig("user", 6, 8, ("user_id",), kind="common", sharding="row_wise"),
    ]
    with pytest.raises(ValueError, match=r"model.tables\[user\].sharding: TorchRec shards common tables on cpu"):
        shard_model(model(tables), EmbeddingOptimizerConfig(), torch.device("cpu"))


def test_host_placement_puts_tables_in_host_memory():
    assert table_device(torch.device("cuda", 1), "host") == torch.device("cpu")
    assert table_device(torch.device("cuda", 1), "device") == torch.device("cuda", 1)
    # An accelerator without TorchRec kernels (an NPU on an Ascend host; XPU constructs without hardware).
    with pytest.raises(
        ValueError, match="sparse.placement: TorchRec has no embedding kernels for xpu; use placement: host"
    ):
        table_device(torch.device("xpu", 0), "device")
    assert table_device(torch.device("xpu", 0), "host") == torch.device("cpu")


def test_optimizer_config_maps_to_fbgemm_arguments():
    adam = EmbeddingOptimizerConfig("adam", lr=0.01, betas=(0.8, 0.9), weight_decay=0.1)
    assert adam.fused_kwargs()["beta1"] == 0.8 and adam.fused_kwargs()["beta2"] == 0.9
    assert "beta1" not in EmbeddingOptimizerConfig("rowwise_adagrad").fused_kwargs()
    assert dataclasses.asdict(EmbeddingOptimizerConfig.from_dict({"type": "sgd"}, "x"))["type"] == "sgd"
    with pytest.raises(ValueError, match=r"x: unknown key\(s\) \['beta'\]"):
        EmbeddingOptimizerConfig.from_dict({"beta": 0.9}, "x")
