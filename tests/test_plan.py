"""gr.train.memory and gr plan: parameter counts equal the built model's, the activation estimate matches torch's
CPU memory profiler, FLOPs match torch's FLOP counter, the memory estimate is built of each sparse
backend's terms (bench/memory.py compares it with training processes' peaks), and the command line
reads the trainer's config."""

import dataclasses

import pytest
import torch
import yaml
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from gr.commands.plan import main
from gr.data.datamodule import SequenceDataModule
from gr.hstu import HSTU, HSTUConfig
from gr.hstu.kernels.attention import cpu as cpu_kernel
from gr.sparse.tables import TableConfig
from gr.train.build import build_model
from gr.train.config import TrainConfig
from gr.train.memory import (
    GIB,
    Plan,
    check_memory_fits,
    hstu_activation_bytes,
    hstu_forward_flops_per_token,
    hstu_parameter_count,
    make_plan,
    plan_from_config,
)
from helpers.runs import recipe

RANKING = (
    ("data.task", "ranking"),
    ("data.item_features", True),
    ("data.user_features", True),
    (
        "data.ranking",
        {
            "positives_per_sample": 2,
            "samples_per_user": 2,
            "num_negatives": 4,
            "eval_num_negatives": 9,
            "tasks": [{"name": "watch"}],
        },
    ),
    ("task", {"ranking": {}}),
    (
        "model.tables",
        [
            {"name": "item", "embedding_dim": 16, "features": ["item_id"]},
            {"name": "category", "embedding_dim": 6, "features": ["item_category"]},  # stored 8 wide
            {"name": "age", "embedding_dim": 4, "features": ["user_age"], "kind": "common"},
            {"name": "gender", "embedding_dim": 4, "features": ["user_gender"], "kind": "common"},
        ],
    ),
)


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        (
            ("model.hstu.position_embedding", False),
            ("model.hstu.time_buckets", 0),
            ("model.hstu.position_buckets", 0),
            ("model.hstu.num_heads", 1),
        ),
    ],
)
def test_hstu_parameter_count_equals_the_built_stack(overrides):
    config = TrainConfig.from_dict(recipe(*overrides)).model.hstu
    assert hstu_parameter_count(config) == sum(p.numel() for p in HSTU(config).parameters())


def test_sparse_and_dense_counts_equal_the_built_model_and_shard_over_ranks():
    config = TrainConfig.from_dict(recipe(*RANKING, ("distributed.dense_sharding", "fsdp2")))
    plan = plan_from_config(config, nproc=3)
    data = SequenceDataModule(config.data)
    data.setup()
    model = build_model(config, data.feature_spec(), data.tasks)
    tables = {t.name: t for t in plan.tables}
    for name in ("item", "category", "age", "gender"):
        assert tables[name].params == model.embeddings.table_weight(name).shape[0] * tables[name].dim
        assert sum(tables[name].params_per_rank) == tables[name].params
    stored = sum(p.numel() for n, p in model.named_parameters() if n.startswith("embeddings."))
    assert plan.sparse_params == stored
    assert tables["category"].dim == 8 and tables["item"].sharding == "row_wise"
    assert sorted(tables["age"].params_per_rank)[:2] == [0, 0]  # table-wise: whole on one rank
    for module in ("prefix_dnn", "hstu", "postfix_dnn"):
        assert plan.dense_params[module] == sum(p.numel() for p in getattr(model, module).parameters()), module
    assert plan.dense_params["prefix_dnn"] > 0 and plan.dense_params["postfix_dnn"] > 0
    replicated = plan.dense_params["prefix_dnn"] + plan.dense_params["postfix_dnn"]
    assert sum(p - replicated for p in plan.dense_params_per_rank) == plan.dense_params["hstu"]
    assert plan.tokens_per_sample == config.data.max_seq_len + 2 + 4  # history + positives + negatives
    assert plan.process_bytes > 0  # this process's resident set, measured when planned


def measured_activation_bytes(config: HSTUConfig, seq_len: int, precision: str) -> float:
    """Bytes per token a training forward of the stack leaves allocated (torch's CPU memory
    profiler), as the difference between batches of 4 and 2 sequences (constant terms such
    as bf16 weight copies and the CPU kernel's layouts shared across batches cancel: both are
    made afresh for each batch size)."""
    allocated = {}
    for batch in (2, 4):
        cpu_kernel._shared_positions.cache_clear()
        torch.manual_seed(0)
        stack = HSTU(config).train()
        x = torch.randn(batch * seq_len, config.hidden_dim)
        offsets = torch.arange(batch + 1) * seq_len
        timestamps = torch.arange(batch * seq_len) * 60
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                out = stack(x, offsets, seq_len, timestamps)
        allocated[batch] = sum(e.self_cpu_memory_usage for e in prof.events())
        del out
    return (allocated[4] - allocated[2]) / (2 * seq_len)


@pytest.mark.parametrize(
    "recompute, precision, dropout",
    [
        *((mode, precision, 0.2) for mode in ("none", "attention", "layer") for precision in ("32-true", "bf16-mixed")),
        ("none", "32-true", 0.0),
        ("none", "bf16-mixed", 0.0),
    ],
)
def test_activation_estimate_matches_the_profiled_forward(recompute, precision, dropout):
    """Within 2%: the model counts every tensor the layers keep; what it leaves out (a few
    index tensors of the kernel's bookkeeping) is a few bytes per token."""
    config = HSTUConfig(
        hidden_dim=64,
        num_layers=2,
        num_heads=2,
        attention_dim=32,
        linear_dim=32,
        max_seq_len=64,
        dropout=dropout,
        input_dropout=dropout,
        recompute=recompute,
    )
    estimate, peak = (b / 64 for b in hstu_activation_bytes(config, 64, recompute, 4 if precision == "32-true" else 2))
    assert estimate == pytest.approx(measured_activation_bytes(config, 64, precision), rel=0.02)
    full = [
        b / 64
        for b in hstu_activation_bytes(
            dataclasses.replace(config, recompute="none"), 64, "none", 4 if precision == "32-true" else 2
        )
    ]
    assert peak - estimate >= full[1] - full[0] and (peak - estimate > full[1] - full[0]) == (recompute != "none")


def test_forward_flops_per_token_match_the_flop_counter(monkeypatch):
    """torch's FLOP counter sees the projections and the attention-times-V matmuls of the unfused
    CPU kernel (not those inside the fused tiles, hence GR_CPU_FUSED=0; its q.k is an in-place
    baddbmm_, which it does not count either), so compare with the estimate less its q.k half.
    The kernel multiplies whole 128-key blocks of a chunk (the diagonal one masked after): at
    most one block per query beyond the causal average."""
    monkeypatch.setenv("GR_CPU_FUSED", "0")
    config = HSTUConfig(hidden_dim=64, num_layers=2, num_heads=2, attention_dim=32, linear_dim=32, max_seq_len=512)
    stack = HSTU(config).train()
    x, offsets = torch.randn(512, 64), torch.tensor([0, 512])
    with FlopCounterMode(display=False) as counter:
        stack(x, offsets, 512, torch.arange(512))
    counted = counter.get_total_flops() / 512
    per_key = config.num_layers * 2 * config.num_heads  # per key and per q/k (or v) dim
    estimate_without_qk = hstu_forward_flops_per_token(config, 512) - per_key * config.attention_dim * (512 + 1) / 2
    assert estimate_without_qk <= counted <= estimate_without_qk + per_key * config.linear_dim * 128


def test_command_line_reads_overrides_and_says_whether_it_fits(tmp_path, capsys):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe()))
    assert main(["--config", str(path), "--nproc", "2", "--memory-gib", "64", "--model.hstu.num_layers", "3"]) == 0
    out = capsys.readouterr().out  # (the estimate holds this test process's resident set)
    assert "fits in 64.0 GiB" in out and "item: " in out and "recompute" in out and "process " in out
    assert main(["--config", str(path), "--memory-gib", "0.0001"]) == 0
    assert "does NOT fit" in capsys.readouterr().out
    assert main(["--config", str(path), "--model.hstu.recompute", "some"]) == 2
    assert "recompute: expected one of ['none', 'attention', 'layer']" in capsys.readouterr().err


D = 32  # the tables' stored width below


def one_table_plan(backend: str, rows: int, optimizer: str = "rowwise_adagrad", nproc: int = 1) -> Plan:
    """The plan of the test recipe with one item table of ``rows`` x ``D`` (no tensor made, no process measured)."""
    config = TrainConfig.from_dict(
        recipe(("sparse.backend", backend), ("sparse.optimizer", {"type": optimizer, "lr": 0.05}))
    )
    return make_plan(config, [TableConfig("item", rows, D, ("item_id",))], nn.Identity(), nn.Identity(), nproc)


@pytest.mark.parametrize(
    "optimizer, torch_bytes, torchrec_bytes",
    [
        # weights 4D + one sum a row 4, and 7D while a checkpoint's weights are checked finite;
        # torchrec: + the whole table as built 4D and its RowWiseAdagrad's row sums 4
        ("rowwise_adagrad", 11 * D + 4, 15 * D + 8),
        ("sgd", 11 * D, 15 * D),  # no state
        ("adagrad", 16 * D, 20 * D),  # sums 4D; loading weights and sums (8D) outgrows the finite check
        ("adam", 20 * D, 24 * D),  # two moments 8D; loading the two largest tensors 8D
        ("partial_rowwise_adam", 16 * D + 4, 20 * D + 4),
    ],
)
def test_memory_grows_with_rows_by_the_backends_bytes_per_row(optimizer, torch_bytes, torchrec_bytes):
    for backend, per_row in (("torch", torch_bytes), ("torchrec", torchrec_bytes)):
        small, large = (
            max(one_table_plan(backend, rows, optimizer).memory_bytes_per_rank) for rows in (10**6, 3 * 10**6)
        )
        assert large - small == 2 * 10**6 * per_row, backend


def test_torchrec_ranks_hold_the_whole_table_as_built_beside_their_shard_and_torch_only_the_table():
    rows = 10**6
    plan = one_table_plan("torchrec", rows, nproc=4)
    assert plan.tables[0].rows_per_rank == (rows // 4,) * 4
    for memory in plan.sparse_memory_per_rank:
        assert memory.shards == 4 * (rows // 4) * (D + 1)  # the rank's rows and their sums
        assert memory.backend == 4 * rows * (D + 1)  # the whole table and RowWiseAdagrad's sums of it, on every rank
        assert memory.build == 4 * rows * D  # RowWiseAdagrad's full_like of the whole table (> the rank's copy)
        assert memory.checkpoint == 7 * (rows // 4) * D  # the shard checked finite
    (alone,) = one_table_plan("torch", rows).sparse_memory_per_rank
    assert (alone.shards, alone.backend, alone.build, alone.checkpoint) == (4 * rows * (D + 1), 0, 0, 7 * rows * D)


def test_torchrec_copies_one_collection_at_a_time_into_its_shards():
    """Sequence tables of one embedding dim share a collection, sharded (and copied) together."""
    rows = 10**6
    config = TrainConfig.from_dict(recipe(("sparse.optimizer", {"type": "sgd", "lr": 0.05})))

    def build(dims):
        tables = [TableConfig(f"t{i}", rows, dim, (f"f{i}",)) for i, dim in enumerate(dims)]
        return make_plan(config, tables, nn.Identity(), nn.Identity(), 1).sparse_memory_per_rank[0].build

    assert build([D, D]) == 2 * 4 * rows * D
    assert build([D, 2 * D]) == 4 * rows * 2 * D


def test_the_check_counts_the_process_less_what_it_holds_already():
    plan = dataclasses.replace(one_table_plan("torch", 10**6), process_bytes=GIB)
    assert max(plan.memory_bytes_per_rank) == max(one_table_plan("torch", 10**6).memory_bytes_per_rank) + GIB
    config = TrainConfig.from_dict(recipe(("sparse.backend", "torch")))
    more = max(plan.memory_bytes_per_rank) - GIB  # what the run adds to a process holding 1 GiB
    check_memory_fits(plan, config, 1, available=more, resident=GIB)
    with pytest.raises(ValueError, match=r"model.tables \(item\): num_embeddings 1,000,000 x embedding_dim 32"):
        check_memory_fits(plan, config, 1, available=more - 1, resident=GIB)
    with pytest.raises(ValueError, match=r"2 rank\(s\)"):  # another local rank needs all of its own
        check_memory_fits(plan, config, 2, available=more + GIB, resident=GIB)
