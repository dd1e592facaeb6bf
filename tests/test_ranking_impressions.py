"""Ranking from impressions (``data.ranking.candidates: impressions``): the candidates are the items
shown, labelled by the file's label column, and AUC / GAUC are computed over them."""

import itertools

import numpy as np
import pytest
import torch

from gr import GRModel, HSTUConfig, TableConfig
from gr.data import SequenceDataModule
from gr.data.config import DataConfig
from gr.postfix_dnn import MMoERankingHead
from gr.prefix_dnn import MLPTokenEncoder
from gr.train.config import RankingSection
from gr.train.tasks import RankingTask

# user -> the items shown to it, in time order, and whether it clicked each
SHOWN = {
    1: ([10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [1, 0, 0, 1, 1, 0, 1, 0, 0, 1]),
    2: ([20, 21, 22, 10, 11, 23, 24, 25, 26, 27], [0, 1, 1, 0, 1, 0, 1, 1, 0, 1]),
    3: ([30, 31, 12, 32, 33, 34, 35, 36, 37], [1, 1, 0, 0, 1, 0, 0, 1, 0]),
}
SPLIT_TIME = 6  # each user's events 6.. are its test impressions (the first of them validates)
IMPRESSIONS = {"candidates": "impressions", "positives_per_sample": 2, "samples_per_user": 2}
TASKS = [{"name": "click", "min_rating": 1}]


@pytest.fixture(scope="module")
def impressions_file(tmp_path_factory):
    rows = ["user,item,time,clicked"]
    for user, (items, clicks) in SHOWN.items():
        rows += [f"{user},{item},{t},{click}" for t, (item, click) in enumerate(zip(items, clicks))]
    path = tmp_path_factory.mktemp("impressions") / "impressions.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def impressions_module(path, **overrides):
    values = {
        "source": "csv",
        "path": str(path),
        "task": "ranking",
        "max_seq_len": 20,
        "batch_size": 8,
        "columns": {"user": "user", "item": "item", "timestamp": "time", "rating": "clicked"},
        "ranking": {**IMPRESSIONS, "tasks": TASKS},
        **overrides,
    }
    dm = SequenceDataModule(values)
    dm.setup()
    return dm


def per_sequence(batch, values):
    offsets = batch.seq_offsets.tolist()
    return [values[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


def model_for(dm):
    spec = dm.feature_spec()
    tables = [TableConfig(name, cardinality, 8, (name,)) for name, cardinality in spec.sequence.items()]
    head = MMoERankingHead(16, list(dm.tasks))
    config = HSTUConfig(hidden_dim=16, attention_dim=8, linear_dim=8, max_seq_len=20, dropout=0.0)
    torch.manual_seed(0)
    return GRModel(config, MLPTokenEncoder({name: 8 for name in spec.sequence}, 16), head, tables)


def test_impression_batches_hold_exactly_the_shown_items_with_their_labels_and_train_a_step(impressions_file):
    dm = impressions_module(impressions_file)
    batch = next(iter(dm.train_dataloader()))
    assert batch.num_targets.tolist() == [2] * len(batch.num_targets)  # the shown items alone, none sampled
    tokens = per_sequence(batch, dm.item_map.decode(batch.sequence_ids["item_id"].values().numpy()))
    labels = batch.labels["click"].view(-1, 2).tolist()
    samples = []
    for b, user in enumerate(dm.user_map.decode(batch.labels["user"].numpy()).tolist()):
        items, clicks = SHOWN[int(user)]
        cut = len(tokens[b]) - 2
        assert tokens[b] == items[: cut + 2]  # the history, then the next two items shown
        assert labels[b] == [float(c) for c in clicks[cut : cut + 2]]
        samples.append((int(user), cut))
    train_ends = {user: len(items) - 2 for user, (items, _) in SHOWN.items()}  # leave-one-out holds two out
    assert sorted(samples) == sorted((u, end - 2 * k) for u, end in train_ends.items() for k in (1, 2))
    model, task = model_for(dm), RankingTask(RankingSection(), dm.tasks)
    loss = task.loss(model(batch), batch)["loss"]
    loss.backward()
    assert torch.isfinite(loss)
    assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())


def hand_auc(scores, labels):
    """Pairwise AUC: the share of (positive, negative) pairs ordered right, ties counting half."""
    pairs = [(p, n) for p, n in itertools.product(range(len(labels)), repeat=2) if labels[p] and not labels[n]]
    return sum(1.0 if scores[p] > scores[n] else 0.5 if scores[p] == scores[n] else 0.0 for p, n in pairs) / len(pairs)


def test_auc_and_gauc_over_test_impressions_equal_a_hand_computation(impressions_file):
    dm = impressions_module(impressions_file, split="time", split_time=SPLIT_TIME, test_events="all")
    model, task = model_for(dm).eval(), RankingTask(RankingSection(), dm.tasks)
    task.start_evaluation(None)
    scored = []  # (user, item, label, logit) per candidate
    with torch.no_grad():
        for batch in dm.test_dataloader():
            output = model(batch)
            task.evaluation_step(output, batch)
            users = dm.user_map.decode(batch.labels["user"].numpy())
            for b, tokens in enumerate(per_sequence(batch, batch.sequence_ids["item_id"].values())):
                assert batch.num_targets[b] == 1  # each impression scored with the history before it
                scored.append((int(users[b]), int(dm.item_map.decode(np.array(tokens[-1:]))[0])))
            labels, logits = batch.labels["click"].tolist(), output.predictions["click"].tolist()
            scored[-len(labels) :] = [
                (*s, label, logit) for s, label, logit in zip(scored[-len(labels) :], labels, logits)
            ]
    metrics = task.finish_evaluation()
    expected = sorted(
        (user, item, float(click))
        for user, (items, clicks) in SHOWN.items()
        for item, click in list(zip(items, clicks))[SPLIT_TIME + 1 :]
    )
    assert sorted(s[:3] for s in scored) == expected  # every test impression once, with its label
    logits, labels = [s[3] for s in scored], [s[2] for s in scored]
    assert metrics["auc/click"] == pytest.approx(hand_auc(logits, labels))
    per_user = [[s for s in scored if s[0] == user] for user in SHOWN]
    gauc = sum(len(u) * hand_auc([s[3] for s in u], [s[2] for s in u]) for u in per_user) / len(scored)
    assert metrics["gauc/click"] == pytest.approx(gauc)


@pytest.mark.parametrize(
    "ranking, message",
    [
        ({"candidates": "shown"}, r"data\.ranking\.candidates: .*'sampled', 'impressions'"),
        (
            {"candidates": "impressions", "num_negatives": 4, "tasks": TASKS},
            r"data\.ranking\.num_negatives: candidates: impressions samples no items",
        ),
        (
            {"candidates": "impressions", "eval_num_negatives": 9, "tasks": TASKS},
            r"data\.ranking\.eval_num_negatives: candidates: impressions samples no items",
        ),
        (
            {"candidates": "impressions", "tasks": [{"name": "watch"}, *TASKS]},
            r"data\.ranking\.tasks: .*give every task a min_rating \(missing for \['watch'\]\)",
        ),
    ],
)
def test_impression_config_errors_name_the_key(ranking, message):
    with pytest.raises(ValueError, match=message):
        DataConfig.from_dict({"task": "ranking", "ranking": ranking})


def test_impressions_draw_no_negatives_by_default():
    ranking = DataConfig.from_dict(
        {"task": "ranking", "ranking": {"candidates": "impressions", "tasks": TASKS}}
    ).ranking
    assert (ranking.num_negatives, ranking.eval_num_negatives) == (0, 0)


def test_impressions_without_a_label_column_is_a_config_error(impressions_file):
    with pytest.raises(
        ValueError,
        match=r"data\.ranking\.candidates: impressions .*impressions\.csv has no .*\(set data\.columns\.rating",
    ):
        impressions_module(impressions_file, columns={"user": "user", "item": "item", "timestamp": "time"})
