"""Warm start (``gr train --init-from RUN``): a run on new data begins from a trained run's model.
Known ids keep their rows (maps extended, never renumbered), new ids get new rows that train,
the tables' optimizer state is carried for the known rows, the run logs and records the checkpoint
it began from and the ids it added, and a model that differs is refused naming the key before any
data is read."""

import copy
import csv
import json
import logging
import math
import re
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import pytest
import torch
import yaml

from gr.commands.evaluate import evaluate_run
from gr.data.datamodule import SequenceDataModule
from gr.data.mappings import MANIFEST, load_mappings
from gr.sparse.torch_tables import attach_optimizers
from gr.train import checkpoint as ckpt
from gr.train import load_trained_model
from gr.train.build import dense_optimizer, seeded_model
from gr.train.config import OptimizerSection, TrainConfig, WarmStartSection, config_yaml, load_config
from gr.train.module import lr_factor
from gr.train.run import _warm_start, best_checkpoint, train
from helpers.runs import RETRIEVAL, ratings_csv

ITEM_WEIGHT = "embeddings.sequence.dim16.embeddings.item.weight"


def _config(path: Path, backend: str = "torch", **trainer) -> TrainConfig:
    values = copy.deepcopy(RETRIEVAL)
    values["data"].pop("synthetic")
    values["data"].update(source="csv", path=str(path), columns={"rating": "rating"})
    values["sparse"]["backend"] = backend
    values["trainer"].update(max_epochs=1, **trainer)
    return TrainConfig.from_dict(values)


@pytest.fixture(scope="module")
def day_runs(tmp_path_factory):
    """Day 0: the events before the 70th time percentile, without the items above 80 (new on day 1);
    a 1-epoch run on it. Day 1: every event."""
    root = tmp_path_factory.mktemp("warm")
    everything = ratings_csv(root / "all.csv")
    lines = everything.read_text().splitlines()
    rows = [line.split(",") for line in lines[1:]]
    cut = np.percentile([int(r[2]) for r in rows], 70)
    day0 = [line for line, r in zip(lines[1:], rows) if int(r[2]) < cut and int(r[1]) <= 80]
    (root / "day0.csv").write_text("\n".join([lines[0], *day0]) + "\n")
    train(_config(root / "day0.csv"), root / "day0")
    return root


def test_known_ids_keep_their_rows_and_new_ids_get_new_ones(day_runs):
    config = _config(day_runs / "all.csv", init_from=str(day_runs / "day0"))
    warm = _warm_start(config)
    old_items = load_mappings(str(day_runs / "day0" / "mappings"))[0]["items"]
    data = SequenceDataModule(config.data, base_maps=warm.maps)
    data.setup()
    assert data.item_map.raw[: len(old_items.raw)].tolist() == old_items.raw.tolist()  # extended, not renumbered
    new_items = data.item_map.raw[len(old_items.raw) :]
    assert (new_items > 80).sum() >= 10  # the items day 0 never saw
    model = seeded_model(config, data.feature_spec())
    fresh = model.state_dict()[ITEM_WEIGHT].clone()
    warm.copy_weights(model)
    rows, trained = model.state_dict()[ITEM_WEIGHT], load_trained_model(day_runs / "day0")[0].state_dict()
    assert torch.equal(rows[: len(old_items.raw)], trained[ITEM_WEIGHT])  # bit-identical
    assert torch.equal(rows[len(old_items.raw) :], fresh[len(old_items.raw) :])  # new rows: fresh init
    dense = [k for k in trained if not k.startswith("embeddings.")]
    assert dense and all(torch.equal(model.state_dict()[k], trained[k]) for k in dense)


def _warm(day_runs: Path, optimizer: Optional[Dict[str, Any]] = None, **warm_start):
    """A warm start from day 0 on every event, ``optimizer`` and ``warm_start`` keys set:
    (config, WarmStart, its data set up)."""
    values = _config(day_runs / "all.csv", init_from=str(day_runs / "day0")).to_dict()
    values["warm_start"].update(warm_start)
    values["optimizer"].update(optimizer or {})
    config = TrainConfig.from_dict(values)
    warm = _warm_start(config)
    data = SequenceDataModule(config.data, base_maps=warm.maps)
    data.setup()
    return config, warm, data


def test_a_shrunk_warm_start_begins_each_carried_weight_between_the_runs_and_its_fresh_initialisation(day_runs):
    """shrink 0.25: a quarter of the run's value, three quarters of the new run's fresh one, for
    the run's table rows and the dense parameters; new rows keep their fresh initialisation."""
    config, warm, data = _warm(day_runs, shrink=0.25)
    model = seeded_model(config, data.feature_spec())
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    warm.copy_weights(model)
    trained, started = load_trained_model(day_runs / "day0")[0].state_dict(), model.state_dict()
    known = trained[ITEM_WEIGHT].shape[0]
    assert torch.equal(started[ITEM_WEIGHT][known:], fresh[ITEM_WEIGHT][known:])
    floats = [k for k, v in trained.items() if v.is_floating_point()]
    assert ITEM_WEIGHT in floats and len(floats) > 1
    for name in floats:
        old = trained[name]
        expected = 0.25 * old + 0.75 * fresh[name][: old.shape[0]]
        assert torch.allclose(started[name][: old.shape[0]], expected, atol=1e-7), name
    assert not torch.equal(started[ITEM_WEIGHT][:known], trained[ITEM_WEIGHT])


def test_the_tables_optimizer_state_is_carried_for_known_rows_and_zero_for_new_ones(day_runs):
    config, warm, data = _warm(day_runs, table_optimizer_state="carry")
    model = seeded_model(config, data.feature_spec())
    optimizers = attach_optimizers(model, config.sparse.optimizer)
    warm.copy_table_optimizer_state(optimizers)
    (state,) = [v for k, v in optimizers.state_dict()["state"][ITEM_WEIGHT].items() if k.endswith("momentum1")]
    (old,) = [v for k, v in warm.table_optimizer_state["state"][ITEM_WEIGHT].items() if k.endswith("momentum1")]
    assert old.abs().sum() > 0  # the day-0 run trained its rows
    assert torch.equal(state[: len(old)], old) and not state[len(old) :].any()


def test_a_reset_table_optimizer_state_starts_every_row_at_zero(day_runs):
    """The recipe's default."""
    config, warm, data = _warm(day_runs)
    assert config.warm_start.table_optimizer_state == "reset"
    optimizers = attach_optimizers(seeded_model(config, data.feature_spec()), config.sparse.optimizer)
    warm.copy_table_optimizer_state(optimizers)
    (state,) = [v for k, v in optimizers.state_dict()["state"][ITEM_WEIGHT].items() if k.endswith("momentum1")]
    (old,) = [v for k, v in warm.table_optimizer_state["state"][ITEM_WEIGHT].items() if k.endswith("momentum1")]
    assert old.abs().sum() > 0 and not state.any()


@pytest.mark.parametrize("policy", ["carry", "fresh"])
def test_a_carried_dense_optimizer_state_is_the_checkpoints_and_a_fresh_one_is_empty(day_runs, policy):
    """Adam's moments and step count of each dense parameter, under the new run's learning rate;
    the weights are untouched either way (bit-identical at step 0)."""
    config, warm, data = _warm(day_runs, {"lr": 0.0007}, dense_optimizer_state=policy)
    model = seeded_model(config, data.feature_spec())
    warm.copy_weights(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    dense = [(name, p) for name, p in model.named_parameters() if not name.startswith("embeddings.")]
    optimizer = dense_optimizer(config.optimizer, [p for _, p in dense])
    warm.copy_dense_optimizer_state(optimizer, dense)
    state = optimizer.state_dict()["state"]
    saved = ckpt.read_meta(best_checkpoint(day_runs / "day0"))["optimizer_states"][0]["state"]
    if policy == "fresh":
        assert state == {}
    else:
        assert len(state) == len(dense) == len(saved) and saved[0]["step"] > 0
        for i in saved:
            assert all(torch.equal(state[i][k], saved[i][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert optimizer.param_groups[0]["lr"] == 0.0007
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


def test_carrying_the_dense_optimizer_state_of_another_optimizer_type_is_refused_naming_the_key(day_runs):
    values = _config(day_runs / "absent.csv", init_from=str(day_runs / "day0")).to_dict()
    values["warm_start"]["dense_optimizer_state"] = "carry"
    values["optimizer"]["type"] = "sgd"
    with pytest.raises(ValueError, match=r"^optimizer\.type: 'sgd' here, 'adamw' in .*day0; warm_start\.dense_opt"):
        train(TrainConfig.from_dict(values), day_runs / "refused")


@pytest.mark.parametrize(
    "decay, factors",
    [
        ("none", [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0]),
        ("linear", [0.25, 0.5, 0.75, 1.0, 0.8, 0.6, 0.4, 0.2]),
        ("cosine", [0.25, 0.5, 0.75, 1.0, *(0.2 + 0.4 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3, 4))]),
    ],
)
def test_the_dense_learning_rate_warms_up_then_decays_to_its_floor_at_the_last_step(decay, factors):
    opt = OptimizerSection(warmup_steps=4, lr_decay=decay, lr_floor=0.2)
    assert [lr_factor(opt, step, 8) for step in range(8)] == pytest.approx(factors)
    assert lr_factor(opt, 20, 8) == pytest.approx(factors[-1])  # past the estimate: the floor


def test_replay_days_replays_only_the_last_days_before_the_train_start(tmp_path):
    day = 86_400
    warm = [("trainer.init_from", "runs/day0"), ("warm_start.replay_days", "2.5")]
    config = load_config(_recipe_file(tmp_path), warm)
    assert config.data.replay_start == 1_700_000_000 - 2.5 * day and config.data.replay > 0
    given = load_config(_recipe_file(tmp_path), [*warm, ("data.replay_start", "1699000000")])
    assert given.data.replay_start == 1_699_000_000 and given.warm_start.replay_days is None  # resumes alike
    none = load_config(_recipe_file(tmp_path), [*warm, ("warm_start.replay", "0")])
    assert none.data.replay_start is None  # nothing replayed: no start
    assert load_config(_recipe_file(tmp_path), warm[:1]).data.replay_start is None  # null: every earlier event


def test_validation_days_validate_the_last_days_before_the_cut_under_a_time_split(tmp_path):
    warm = [("trainer.init_from", "runs/day0"), ("warm_start.validation_days", "1")]
    timed = [*warm, ("data.split", "time"), ("data.split_time", "1700500000")]
    assert load_config(_recipe_file(tmp_path), timed).data.val_start == 1_700_500_000 - 86_400
    given = load_config(_recipe_file(tmp_path), [*timed, ("data.val_start", "1700400000")])
    assert given.data.val_start == 1_700_400_000 and given.warm_start.validation_days is None
    assert load_config(_recipe_file(tmp_path), warm).data.val_start is None  # split none: nothing to validate


def _recipe_file(tmp_path: Path, **trainer) -> Path:
    """A config file as a cold recipe writes it: many epochs, early stopping, a split none day cut."""
    values = copy.deepcopy(RETRIEVAL)
    values["data"].update(split="none", train_start=1_700_000_000)
    values["trainer"].update(max_epochs=100, early_stopping_patience=0, **trainer)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_init_from_applies_the_warm_start_recipe_over_the_config_file(tmp_path):
    recipe, path = WarmStartSection(), _recipe_file(tmp_path)
    warm = load_config(path, [("trainer.init_from", "runs/day0")])
    assert recipe.replay and recipe.max_epochs != 100
    assert warm.trainer.max_epochs == recipe.max_epochs and warm.data.replay == recipe.replay
    assert warm.trainer.early_stopping_patience == recipe.early_stopping_patience
    cold = load_config(path)
    assert cold.trainer.max_epochs == 100 and cold.data.replay == 0  # a cold run reads no warm_start key
    no_day = load_config(path, [("trainer.init_from", "runs/day0"), ("data.train_start", "null")])
    assert no_day.data.replay == 0  # without a train start every event trains: nothing to replay


def test_keys_given_on_the_command_line_win_over_the_recipe_and_resume_alike(tmp_path):
    given = [("trainer.init_from", "runs/day0"), ("trainer.max_epochs", "3"), ("warm_start.replay", "0.5")]
    warm = load_config(_recipe_file(tmp_path), given)
    assert warm.trainer.max_epochs == 3 and warm.data.replay == 0.5
    assert warm.warm_start.max_epochs == 3  # recorded: the run's config.yaml says what it ran
    saved = tmp_path / "config.yaml"
    saved.write_text(config_yaml(warm))
    assert load_config(saved) == warm  # --resume reads the run's config.yaml
    assert load_config(saved, [("trainer.max_epochs", "5")]).trainer.max_epochs == 5
    null = load_config(_recipe_file(tmp_path), [("trainer.init_from", "runs/day0"), ("warm_start.max_epochs", "null")])
    assert null.trainer.max_epochs == 100  # null: the config file's value


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("warm_start.replay", "2", r"warm_start\.replay: expected null or a number in \[0\.0, 1\.0\], got 2"),
        ("warm_start.max_epochs", "0", r"warm_start\.max_epochs: expected null or an int >= 1, got 0"),
        ("warm_start.table_optimizer_state", "keep", r"warm_start\.table_optimizer_state: expected one of"),
        ("warm_start.epochs", "3", r"warm_start: unknown key\(s\) \['epochs'\]"),
        ("warm_start.dense_optimizer_state", "keep", r"warm_start\.dense_optimizer_state: expected one of"),
        ("warm_start.lr_decay", "step", r"warm_start\.lr_decay: expected null or one of"),
        ("warm_start.lr_floor", "1.5", r"warm_start\.lr_floor: expected null or a number in \[0\.0, 1\.0\]"),
        ("warm_start.replay_days", "0", r"warm_start\.replay_days: expected null or a number in \(0\.0, inf\]"),
        ("warm_start.validation_days", "-1", r"warm_start\.validation_days: expected null or a number in \(0\.0"),
        ("warm_start.shrink", "0", r"warm_start\.shrink: expected a number in \(0\.0, 1\.0\], got 0"),
    ],
)
@pytest.mark.parametrize("init_from", [[], [("trainer.init_from", "runs/day0")]])
def test_bad_warm_start_keys_are_refused_naming_them_with_or_without_init_from(
    tmp_path, key, value, message, init_from
):
    with pytest.raises(ValueError, match=rf"^--{re.escape(key)} {value} \(command line, over .*\): {message}"):
        load_config(_recipe_file(tmp_path), [*init_from, (key, value)])


@pytest.mark.parametrize("backend, dense_state", [("torch", "fresh"), ("torchrec", "carry")])
def test_a_warm_run_trains_new_rows_on_either_backend_and_records_its_origin(
    day_runs, tmp_path, backend, dense_state, caplog
):
    """Also: the dense optimizer's state carried on TorchRec, the learning rate decaying to its floor."""
    values = _config(day_runs / "all.csv", backend, init_from=str(day_runs / "day0")).to_dict()
    values["warm_start"]["dense_optimizer_state"] = dense_state
    values["optimizer"].update(lr_decay="linear", lr_floor=0.1)  # as warm_start.lr_decay / lr_floor set them
    config = TrainConfig.from_dict(values)
    with caplog.at_level(logging.INFO, logger="gr.train.run"):
        metrics = train(config, tmp_path / "warm")
    assert 0 <= metrics["hr@10"] <= 1
    with (tmp_path / "warm" / "logs" / "metrics.csv").open() as f:
        lrs = [float(row["train/lr"]) for row in csv.DictReader(f) if row["train/lr"]]
    assert len(lrs) > 2 and lrs == sorted(lrs, reverse=True) and lrs[0] > lrs[-1]
    assert lrs[-1] == pytest.approx(0.1 * config.optimizer.lr)
    old = len(load_mappings(str(day_runs / "day0" / "mappings"))[0]["items"].raw)
    origin = metrics["init_from"]
    assert origin["checkpoint"] == json.loads((day_runs / "day0" / "metrics.json").read_text())["best_checkpoint"]
    assert origin["run"] == str((day_runs / "day0").resolve()) and origin["epoch"] == 0 and origin["global_step"] > 0
    assert origin["new_ids"] == {"items": len(load_mappings(str(tmp_path / "warm" / "mappings"))[0]["items"].raw) - old}
    assert origin["new_ids"]["items"] >= 10
    line = f"warm start from {origin['run']}/{origin['checkpoint']} (epoch 0, step {origin['global_step']}); "
    assert [r.getMessage() for r in caplog.records if r.name == "gr.train.run"] == [
        line + f"new ids: items {origin['new_ids']['items']}"
    ]
    maps = load_mappings(str(tmp_path / "warm" / "mappings"))[0]
    data = SequenceDataModule(config.data, base_maps={"items": maps["items"]})
    data.setup()
    fresh = seeded_model(config, data.feature_spec()).state_dict()[ITEM_WEIGHT]
    rows = load_trained_model(tmp_path / "warm")[0].state_dict()[ITEM_WEIGHT]
    assert not torch.equal(rows[old:], fresh[old:])  # the new items' rows trained
    assert TrainConfig.from_dict(metrics["config"]).trainer.init_from == str((day_runs / "day0").resolve())


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("hstu", {"hidden_dim": 32}, r"model\.hstu\.hidden_dim: 32 here, 16 in .*day0; --init-from needs"),
        ("tables", [{"name": "item", "embedding_dim": 8}], r"model\.tables\[0\]\.embedding_dim: 8 here, 16 in"),
    ],
)
def test_a_different_model_is_refused_naming_the_key_before_any_data_is_read(day_runs, key, value, message):
    config = _config(day_runs / "absent.csv", init_from=str(day_runs / "day0"))
    values = config.to_dict()
    if key == "tables":
        values["model"]["tables"][0].update(value[0])
    else:
        values["model"][key].update(value)
    if key == "hstu":
        values["model"]["hstu"].update(attention_dim=8, linear_dim=8)
    with pytest.raises(ValueError, match=message):
        train(TrainConfig.from_dict(values), day_runs / "refused")


def test_an_export_is_refused_as_a_warm_start_source(tmp_path):
    (tmp_path / "MANIFEST").write_text("")
    config = _config(tmp_path / "absent.csv", init_from=str(tmp_path))
    with pytest.raises(ValueError, match=r"trainer\.init_from: .* is an export; warm start reads a run directory"):
        train(config, tmp_path / "run")


def _cut_at_a_line(mappings: Path) -> None:
    lines = (mappings / "items.tsv").read_text().splitlines(keepends=True)
    (mappings / "items.tsv").write_text("".join(lines[: len(lines) // 2]))


def _users_over_items(mappings: Path) -> None:
    shutil.copyfile(mappings / "users.tsv", mappings / "items.tsv")


def _items_from_one(mappings: Path) -> None:
    """Well formed, but numbered as a side feature's values are (0: unknown)."""
    manifest = json.loads((mappings / MANIFEST).read_text())
    manifest["maps"]["items"]["offset"] = 1
    (mappings / MANIFEST).write_text(json.dumps(manifest))
    header, *rows = (mappings / "items.tsv").read_text().splitlines()
    renumbered = [f"{int(dense) + 1}\t{raw}" for dense, raw in (row.split("\t") for row in rows)]
    (mappings / "items.tsv").write_text("\n".join([header, *renumbered]) + "\n")


def _repeated_id(mappings: Path) -> None:
    header, first, *rows = (mappings / "items.tsv").read_text().splitlines()
    last = f"{rows[-1].split(chr(9))[0]}\t{first.split(chr(9))[1]}"
    (mappings / "items.tsv").write_text("\n".join([header, first, *rows[:-1], last]) + "\n")


@pytest.mark.parametrize(
    "corrupt, message",
    [
        pytest.param(_cut_at_a_line, ": {written} item ids, but .* was trained with {trained} ", id="cut"),
        pytest.param(
            _users_over_items,
            r": {written} item ids, but .* was trained with {trained} \(table 'item': {trained} rows\); the map is not",
            id="users",
        ),
        pytest.param(_items_from_one, ": dense ids from 1, but item ids take dense ids from 0$", id="offset"),
        pytest.param(_repeated_id, ":{lines}: raw_id .* repeats line 2 ", id="repeated"),
    ],
)
def test_id_maps_that_do_not_fit_the_runs_checkpoint_are_refused_naming_the_file(day_runs, tmp_path, corrupt, message):
    """A map cut short, another map's file in its place, renumbered or repeating an id: the rows the new
    run would copy are not the rows the checkpoint trained for those ids."""
    shutil.copytree(day_runs / "day0", tmp_path / "day0")
    mappings = tmp_path / "day0" / "mappings"
    trained = len(load_mappings(str(mappings))[0]["items"].raw)
    corrupt(mappings)
    lines = len((mappings / "items.tsv").read_text().splitlines())
    expected = message.format(written=lines - 1, trained=trained, lines=lines)
    config = _config(tmp_path / "absent.csv", init_from=str(tmp_path / "day0"))
    with pytest.raises(ValueError, match=f"^{re.escape(str(mappings / 'items.tsv'))}{expected}") as refused:
        train(config, tmp_path / "warm")
    assert "\n" not in str(refused.value)


def test_new_data_whose_ids_are_of_another_kind_than_the_runs_are_refused_by_a_warm_start_and_evaluation(
    day_runs, tmp_path
):
    header, *rows = (day_runs / "all.csv").read_text().splitlines()
    named = [f"{user},i{item},{rest}" for user, item, rest in (row.split(",", 2) for row in rows)]
    (tmp_path / "named.csv").write_text("\n".join([header, *named]) + "\n")
    config = _config(tmp_path / "named.csv", init_from=str(day_runs / "day0"))
    message = (
        rf"^{re.escape(str(tmp_path / 'named.csv'))}: column 'item_id': the data's ids are strings, those of "
        rf"{re.escape(str((day_runs / 'day0' / 'mappings' / 'items.tsv').resolve()))} \(the model's\) are integers; "
    )
    with pytest.raises(ValueError, match=message):
        train(config, tmp_path / "warm")
    with pytest.raises(
        ValueError, match=message.replace(r"\(the model's\) are integers; ", r"\(the model's\) are integers$")
    ):
        evaluate_run(day_runs / "day0", [("data.path", str(tmp_path / "named.csv"))])  # judged on later data
