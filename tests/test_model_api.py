"""The user API: fixed forward, user hooks, refused overrides, shipped PrefixDNN/PostfixDNN."""

from typing import Dict

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchrec import KeyedJaggedTensor

from gr import GRInput, GRModel, HSTUConfig, PostfixDNN, PrefixDNN, TableConfig
from gr.hstu import HSTU
from gr.postfix_dnn import MMoERankingHead, RetrievalHead
from gr.prefix_dnn import MLPTokenEncoder, check_token_wise

CFG = HSTUConfig(
    hidden_dim=16, attention_dim=8, linear_dim=8, num_heads=2, max_seq_len=32, dropout=0.0, input_dropout=0.0
)


def ranking_model():
    tables = [
        TableConfig("item", 50, 16, ("item_id",)),
        TableConfig("genre", 10, 4, ("genre",)),
        TableConfig("user", 20, 8, ("user_id",), kind="common"),
    ]
    prefix = MLPTokenEncoder({"item_id": 16, "genre": 4, "age": 1}, 16, mlp_dims=(24,))
    postfix = MMoERankingHead(16, ["click", "like"], num_experts=3, common_dims={"user_id": 8})
    return GRModel(CFG, prefix, postfix, tables).eval()


def ranking_batch(lengths, num_targets):
    lengths = torch.tensor(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    total = int(offsets[-1])
    seq_ids = KeyedJaggedTensor.from_lengths_sync(
        ["item_id", "genre"],
        torch.cat([torch.randint(0, 50, (total,)), torch.randint(0, 10, (total,))]),
        torch.cat([lengths, lengths]),
    )
    common = KeyedJaggedTensor.from_lengths_sync(
        ["user_id"], torch.arange(len(lengths)), torch.ones(len(lengths), dtype=torch.long)
    )
    return GRInput(
        seq_offsets=offsets,
        max_seq_len=int(lengths.max()),
        timestamps=torch.arange(total) * 60,
        num_targets=torch.tensor(num_targets),
        sequence_ids=seq_ids,
        token_dense={"age": torch.rand(total, 1)},
        common_ids=common,
    )


def test_fixed_forward_scores_each_target_with_every_task():
    model = ranking_model()
    out = model(ranking_batch([6, 3, 9], [2, 1, 4]))
    assert set(out.predictions) == {"click", "like"}
    assert out.predictions["click"].shape == (7,)
    assert out.row_offsets.tolist() == [0, 2, 3, 7]
    assert out.row_index.tolist() == [4, 5, 8, 14, 15, 16, 17]
    assert out.common_features["user_id"].shape == (3, 8)


def test_retrieval_head_gives_unit_queries_for_every_token_without_targets():
    model = GRModel(
        CFG, MLPTokenEncoder({"item_id": 16}, 16), RetrievalHead(16, 16), [TableConfig("item", 50, 16, ("item_id",))]
    )
    lengths = torch.tensor([4, 1])
    ids = KeyedJaggedTensor.from_lengths_sync(["item_id"], torch.randint(0, 50, (5,)), lengths)
    out = model(GRInput(torch.tensor([0, 4, 5]), 4, torch.arange(5), sequence_ids=ids))
    query = out.predictions["query"]
    assert query.shape == (5, 16)
    torch.testing.assert_close(query.norm(dim=-1), torch.ones(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unit_rows_matches_f_normalize_in_value_and_gradient(dtype):
    """The retrieval head's normalisation (its own backward when a gradient is wanted) gives
    F.normalize's rows and input gradient, a zero row included (its norm is clamped to eps): equal
    to fp32 rounding in fp32; in bf16 within 1 % of the largest fp32 gradient entry, like
    F.normalize's own bf16 gradient (0.6 % here)."""
    from gr.postfix_dnn.retrieval import unit_rows

    torch.manual_seed(0)
    x, dy = torch.randn(40, 16), torch.randn(40, 16)
    x[3] = 0.0
    reference = x.clone().requires_grad_(True)
    F.normalize(reference, dim=-1).backward(dy)
    got_x = x.to(dtype).requires_grad_(True)
    got = unit_rows(got_x)
    assert got.dtype == dtype
    torch.testing.assert_close(got, F.normalize(x.to(dtype), dim=-1))
    got.backward(dy.to(dtype))
    if dtype == torch.float32:
        torch.testing.assert_close(got_x.grad, reference.grad)
    else:
        assert (got_x.grad.float() - reference.grad).abs().max() <= 0.01 * reference.grad.abs().max()
    with torch.no_grad():
        assert torch.equal(unit_rows(x), F.normalize(x, dim=-1))


def test_shipped_prefix_dnn_is_token_wise():
    encoder = MLPTokenEncoder({"item_id": 16, "genre": 4}, 12, mlp_dims=(20,)).eval()
    check_token_wise(encoder, {"item_id": torch.randn(30, 16), "genre": torch.randn(30, 4)})


def test_identity_encoder_passes_its_one_feature_through_without_a_copy():
    encoder = MLPTokenEncoder({"item_id": 8}, hidden_dim=8)
    item = torch.randn(5, 8)
    assert encoder({"item_id": item}).data_ptr() == item.data_ptr()
    both = MLPTokenEncoder({"item_id": 8, "genre": 4}, hidden_dim=12)
    assert torch.equal(both({"item_id": item, "genre": torch.ones(5, 4)}), torch.cat([item, torch.ones(5, 4)], 1))


def test_token_wise_check_catches_a_position_mixing_encoder():
    class Mixer(PrefixDNN):
        feature_names = ("x",)

        def forward(self, features: Dict[str, Tensor]) -> Tensor:
            x = features["x"]
            return x + x.mean(0, keepdim=True)

    with pytest.raises(AssertionError, match="Mixer"):
        check_token_wise(Mixer(), {"x": torch.randn(10, 4)})


def test_user_subclasses_plug_in():
    class Encoder(PrefixDNN):
        feature_names = ("item_id",)

        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, features):
            return torch.tanh(self.proj(features["item_id"]))

    class Head(PostfixDNN):
        output_names = ("score",)

        def __init__(self):
            super().__init__()
            self.out = nn.Linear(16, 1)

        def forward(self, hidden, common):
            return {"score": self.out(hidden).squeeze(-1)}

    class MyModel(GRModel):
        def split_input(self, batch):
            lengths = torch.tensor([len(s) for s in batch["items"]])
            return GRInput(
                seq_offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
                max_seq_len=int(lengths.max()),
                timestamps=torch.cat([torch.tensor(t) for t in batch["times"]]),
                num_targets=torch.ones(len(lengths), dtype=torch.long),
                sequence_ids=KeyedJaggedTensor.from_lengths_sync(
                    ["item_id"], torch.tensor(sum(batch["items"], [])), lengths
                ),
                labels={"score": torch.tensor(batch["label"], dtype=torch.float)},
            )

        def compute_loss(self, output, inputs):
            loss = nn.functional.binary_cross_entropy_with_logits(output.predictions["score"], inputs.labels["score"])
            return {"loss": loss}

    model = MyModel(CFG, Encoder(), Head(), [TableConfig("item", 10, 16, ("item_id",))])
    batch = {"items": [[1, 2, 3], [4, 5]], "times": [[1, 2, 3], [5, 9]], "label": [1.0, 0.0]}
    out = model(batch)
    loss = model.compute_loss(out, model.split_input(batch))["loss"]
    loss.backward()
    assert model.prefix_dnn.proj.weight.grad is not None
    assert model.embeddings.sequence["dim16"].embeddings["item"].weight.grad is not None


@pytest.mark.parametrize("member", ["forward", "hstu", "embed_features", "scored_rows"])
def test_subclass_overriding_the_fixed_pipeline_is_refused(member):
    with pytest.raises(TypeError, match="fixed"):
        type("Bad", (GRModel,), {member: lambda self, *a: None})


def test_replacing_hstu_on_an_instance_is_refused():
    model = ranking_model()
    with pytest.raises(AttributeError, match="HSTUConfig"):
        model.hstu = HSTU(CFG)


def test_wrong_module_types_and_missing_features_are_clear_errors():
    with pytest.raises(TypeError, match="prefix_dnn"):
        GRModel(CFG, nn.Linear(2, 2), RetrievalHead(16, 16))
    model = GRModel(
        CFG,
        MLPTokenEncoder({"item_id": 16, "age": 1}, 16),
        RetrievalHead(16, 16),
        [TableConfig("item", 50, 16, ("item_id",))],
    )
    ids = KeyedJaggedTensor.from_lengths_sync(["item_id"], torch.tensor([1, 2]), torch.tensor([2]))
    with pytest.raises(KeyError, match="age"):
        model(GRInput(torch.tensor([0, 2]), 2, torch.arange(2), sequence_ids=ids))
    with pytest.raises(TypeError, match="split_input"):
        model({"not": "a GRInput"})


def test_public_names_are_visible_to_type_checkers_and_match_the_lazy_ones():
    """Every lazily exported name is also imported under TYPE_CHECKING from the module that defines it, so
    editors and mypy see the class rather than ``Any``."""
    import ast
    import importlib
    from pathlib import Path

    import gr

    tree = ast.parse(Path(gr.__file__).read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    typed = {
        alias.name: node.module for node in guarded.body if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    assert typed == gr._EXPORTS
    assert sorted(gr.__all__) == sorted(typed)
    for name, module in typed.items():
        assert getattr(gr, name) is getattr(importlib.import_module(module), name)


def test_version_is_the_installed_distribution_version():
    from importlib.metadata import version

    import gr

    assert gr.__version__ == version("gr-hstu")
