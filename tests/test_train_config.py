"""The training config: up-front validation naming section.key, dotted overrides, user classes by import path."""

import copy
from typing import Dict

import pytest
import torch
import yaml
from torch import Tensor, nn

from gr.commands.train import parse_args
from gr.data.features import FeatureSpec
from gr.prefix_dnn import PrefixDNN
from gr.train.build import SAMPLED_ITEMS, build_model, build_tables, dense_optimizer
from gr.train.config import OptimizerSection, TrainConfig, apply_override, load_config, parse_value
from helpers.runs import BASE, config, recipe

SPEC = FeatureSpec(sequence={"item_id": 40})


class TinyEncoder(PrefixDNN):
    """A user PrefixDNN referenced from the config by import path."""

    feature_names = ("item_id",)

    def __init__(self, hidden_dim: int, feature_dims: Dict[str, int], scale: float = 1.0):
        super().__init__()
        self.scale = scale
        self.proj = nn.Linear(feature_dims["item_id"], hidden_dim)

    def forward(self, features: Dict[str, Tensor]) -> Tensor:
        return self.proj(features["item_id"]) * self.scale


def config_with(*overrides):
    return config(BASE, *overrides)


@pytest.mark.parametrize(
    "dotted, value, named",
    [
        ("trainer.max_epochs", 0, "trainer.max_epochs"),
        ("trainer.monitor", "val/hr@7", "trainer.monitor"),
        ("trainer.max_epoch", 3, r"trainer: unknown key\(s\) \['max_epoch'\]"),
        ("sparse.placement", "gpu", "sparse.placement"),
        ("sparse.optimizer.type", "adadelta", "sparse.optimizer.type"),
        ("task.retrieval.negatives", "row", "task.retrieval.negatives"),
        ("task.retrieval.negatives_block", 0, r"task.retrieval.negatives_block: expected an int >= 1"),
        ("task.retrieval.temperature", 0, "task.retrieval.temperature"),
        ("task.retrieval.item_feature", "movie", "task.retrieval.item_feature"),
        ("optimizer.betas", [0.9], "optimizer.betas"),
        ("model.tables.0.sharding", "diagonal", r"model.tables\[0\]"),
        ("model.tables.0.embedding_dim", -1, r"model.tables\[0\].embedding_dim"),
        ("model.tables.0.optimizer", {"type": "adam", "lr": -1}, r"model.tables\[0\].optimizer.lr"),
        ("model.hstu.num_heads", 0, r"model.hstu.num_heads: expected an int >= 1"),
        ("model.hstu.max_seq_len", 10, "model.hstu.max_seq_len"),
        ("model.prefix_dnn.class", "gr.prefix_dnn.NoSuchEncoder", "model.prefix_dnn.class"),
        ("model.prefix_dnn.class", "gr.postfix_dnn.RetrievalHead", "not a PrefixDNN subclass"),
        ("model.postfix_dnn.kwargs", {"width": 3}, r"model.postfix_dnn.kwargs: RetrievalHead takes no argument"),
        ("data.batch_size", 0, "data.batch_size"),
    ],
)
def test_invalid_value_is_refused_naming_its_key(dotted, value, named):
    with pytest.raises(ValueError, match=named):
        config_with((dotted, value))


def test_config_file_errors_name_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("data: [unclosed\n")
    with pytest.raises(ValueError, match="broken.yaml: invalid YAML"):
        load_config(path)
    path.write_text(yaml.safe_dump(BASE))
    with pytest.raises(ValueError, match=r"--trainer\.max_epochs -2 \(command line, over .*broken\.yaml\): trainer"):
        load_config(path, [("trainer.max_epochs", "-2")])


def test_dotted_overrides_from_the_command_line_reach_the_config(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(BASE))
    args, overrides = parse_args(
        [
            "--config",
            str(path),
            "--trainer.max_epochs",
            "3",
            "--data.path=../x",
            "--model.tables.0.embedding_dim",
            "12",
            "--task.retrieval.top_k",
            "[5, 20]",
            "--sparse.dedup",
            "false",
            "--out",
            "runs/x",
        ]
    )
    assert args.out == "runs/x"
    assert overrides[:2] == [("trainer.max_epochs", "3"), ("data.path", "../x")]
    config = load_config(path, [o for o in overrides if o[0] != "data.path"])
    assert config.trainer.max_epochs == 3
    assert config.model.tables[0]["embedding_dim"] == 12
    assert config.task.retrieval.top_k == (5, 20)
    assert config.sparse.dedup is False
    assert parse_value("1e-3") == 1e-3 and parse_value("null") is None


def test_a_path_on_the_command_line_that_a_prepared_dataset_would_shadow_is_refused(tmp_path):
    path = tmp_path / "recipe.yaml"
    values = copy.deepcopy(BASE)
    values["data"].update(source="csv", prepared=str(tmp_path / "prepared"))
    path.write_text(yaml.safe_dump(values))
    message = r"^--data\.path later\.csv \(command line, over .*recipe\.yaml\): the config streams data\.prepared "
    with pytest.raises(ValueError, match=message + r".*add --data\.prepared null to read the path$"):
        load_config(path, [("data.path", "later.csv")])
    config = load_config(path, [("data.path", "later.csv"), ("data.prepared", "null")])
    assert config.data.path == "later.csv" and config.data.prepared is None


def test_override_of_a_missing_list_item_is_refused():
    with pytest.raises(ValueError, match="model.tables.3"):
        apply_override(copy.deepcopy(BASE), "model.tables.3.embedding_dim", 8)


def test_round_trip_through_yaml_gives_the_same_config():
    config = config_with(("sparse.optimizer", {"type": "adagrad", "lr": 0.1}), ("trainer.max_epochs", 7))
    again = TrainConfig.from_dict(yaml.safe_load(yaml.safe_dump(config.to_dict())))
    assert again == config


def test_user_prefix_class_by_import_path_gets_context_arguments():
    config = config_with(("model.prefix_dnn", {"class": f"{__name__}.TinyEncoder", "kwargs": {"scale": 2.0}}))
    model = build_model(config, SPEC)
    assert isinstance(model.prefix_dnn, TinyEncoder) and model.prefix_dnn.scale == 2.0
    assert model.prefix_dnn.proj.in_features == 16 and model.prefix_dnn.proj.out_features == 16
    # The retrieval item table also reads the sampled items; a model for inference does not.
    assert SAMPLED_ITEMS in model.embeddings.tables["item"].features
    assert SAMPLED_ITEMS not in build_model(config, SPEC, for_training=False).embeddings.tables["item"].features


def test_table_rows_come_from_the_data_and_every_data_feature_needs_a_table():
    config = config_with()
    (item,) = build_tables(config, SPEC, for_training=False)
    assert item.num_embeddings == 40
    with pytest.raises(ValueError, match=r"model.tables: no table reads the data's common feature\(s\) \['user_age'\]"):
        build_tables(config, FeatureSpec(sequence={"item_id": 40}, common={"user_age": 8}))
    small = config_with(("model.tables.0.num_embeddings", 10))
    with pytest.raises(ValueError, match=r"model.tables\[item\].num_embeddings: 10 rows"):
        build_tables(small, SPEC)


def test_retrieval_needs_a_head_that_embeds_items():
    config = config_with(
        ("model.postfix_dnn.class", "gr.postfix_dnn.MMoERankingHead"),
        ("model.postfix_dnn.kwargs", {"tasks": ["click"]}),
    )
    with pytest.raises(ValueError, match="model.postfix_dnn.class: retrieval scores items"):
        build_model(config, SPEC)


def test_seeded_model_is_identical_across_builds():
    from gr.train.build import seeded_model

    a, b = seeded_model(config_with(), SPEC), seeded_model(config_with(), SPEC)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, msg=name)


@pytest.mark.parametrize("kind", ["adamw", "adam"])
def test_dense_adam_runs_pytorchs_fused_kernel_on_cpu_and_steps_like_the_unfused_one(kind):
    section = OptimizerSection(type=kind, lr=0.01, weight_decay=0.1)
    unfused_cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    torch.manual_seed(0)
    weights = [torch.randn(7, 5), torch.randn(5)]
    grads = [torch.randn_like(w) for w in weights]
    stepped = []
    for fused in (True, False):
        params = [nn.Parameter(w.clone()) for w in weights]
        optimizer = (
            dense_optimizer(section, params)
            if fused
            else unfused_cls(params, lr=0.01, betas=section.betas, eps=section.eps, weight_decay=0.1, fused=False)
        )
        assert type(optimizer) is unfused_cls and bool(optimizer.defaults["fused"]) is fused
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            optimizer.step()
        stepped.append([p.detach() for p in params])
    assert not torch.equal(stepped[0][0], weights[0])
    for a, b in zip(*stepped):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_an_error_in_an_overridden_value_names_the_command_line_not_the_file(tmp_path):
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe()))
    with pytest.raises(ValueError) as caught:
        load_config(recipe_file, [("trainer.max_epochs", "-1")])
    assert str(caught.value).startswith(
        f"--trainer.max_epochs -1 (command line, over {recipe_file}): trainer.max_epochs:"
    )
    with pytest.raises(
        ValueError, match=r"--data\.columns\.item user_id \(command line, over .*\): data\.columns: column"
    ):
        load_config(recipe_file, [("data.source", "csv"), ("data.path", "x.csv"), ("data.columns.item", "user_id")])
    bad = recipe()
    bad["trainer"]["max_epochs"] = -1
    recipe_file.write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match=rf"^{recipe_file}: trainer\.max_epochs:"):
        load_config(recipe_file, [("trainer.num_threads", "1")])


@pytest.mark.parametrize("key", ["split_time", "split_end", "train_start"])
def test_a_date_that_is_no_date_names_its_key_and_what_is_expected(tmp_path, key):
    """YAML reads 2023-13-45 as a date and fails on its month; the key's own check says what it takes."""
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(recipe()))
    expected = r"expected null or an integer number of seconds, or an ISO 8601 date or time .*, got '2023-13-45'$"
    overrides = {"data.split": "time", "data.split_time": "2023-11-15", f"data.{key}": "2023-13-45"}
    with pytest.raises(
        ValueError, match=rf"^--data\.{key} 2023-13-45 \(command line, over .*\): data\.{key}: {expected}"
    ):
        load_config(recipe_file, list(overrides.items()))
    in_file = recipe()
    in_file["data"].update(split="time", **({} if key == "split_time" else {"split_time": 1_700_000_000}))
    recipe_file.write_text(yaml.safe_dump(in_file).replace("data:\n", f"data:\n  {key}: 2023-13-45\n", 1))
    with pytest.raises(ValueError, match=rf"^{recipe_file}: data\.{key}: {expected}"):
        load_config(recipe_file)
