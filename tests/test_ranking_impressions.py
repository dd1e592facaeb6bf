"""Ranking from impressions (``data.ranking.candidates: impressions``): the candidates are the items
shown, labelled by the file's label column, and AUC / GAUC are computed over them."""

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

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


# user -> its requests in time order: (time, [(item, clicked) shown together])
REQUESTS = {
    1: [(0, [(10, 1)]), (1, [(11, 0), (12, 1), (13, 0)]), (2, [(14, 1), (15, 0)]), (3, [(16, 0), (17, 1), (18, 1)])],
    2: [(0, [(20, 0), (21, 1)]), (1, [(22, 1)]), (2, [(23, 0), (24, 1), (25, 0)]), (3, [(26, 1), (27, 0)])],
}


@pytest.fixture(scope="module", params=["csv", "parquet"])
def requests_file(tmp_path_factory, request):
    """The REQUESTS log, a request id per row: as CSV or as Parquet (string request ids)."""
    rows = [
        (user, item, time, click, f"u{user}t{time}")
        for user, requests in REQUESTS.items()
        for time, shown in requests
        for item, click in shown
    ]
    path = tmp_path_factory.mktemp("requests") / f"requests.{request.param}"
    if request.param == "csv":
        path.write_text("\n".join(["user,item,time,clicked,request", *(",".join(map(str, r)) for r in rows)]) + "\n")
    else:
        names = ["user", "item", "time", "clicked", "request"]
        pq.write_table(pa.table({name: [r[i] for r in rows] for i, name in enumerate(names)}), path)
    return path


REQUEST_COLUMNS = {"user": "user", "item": "item", "timestamp": "time", "rating": "clicked", "request": "request"}


def test_a_request_s_impressions_are_one_samples_candidates_and_never_each_others_history(requests_file):
    """Training: each sample is the history before a request, then that request's impressions (at
    most positives_per_sample) with their labels. Evaluation: every test impression is scored with
    the events before its request, none of the request's own."""
    dm = impressions_module(
        requests_file,
        source=requests_file.suffix[1:],
        columns=REQUEST_COLUMNS,
        ranking={**IMPRESSIONS, "positives_per_sample": 3, "samples_per_user": 5, "tasks": TASKS},
        split="time",
        split_time=3,
        test_events="all",
    )
    samples = []
    for batch in dm.train_dataloader():
        tokens = per_sequence(batch, dm.item_map.decode(batch.sequence_ids["item_id"].values().numpy()))
        labels = batch.labels["click"].tolist()
        for b, user in enumerate(dm.user_map.decode(batch.labels["user"].numpy()).tolist()):
            n = int(batch.num_targets[b])
            samples.append((int(user), tokens[b][:-n], tokens[b][-n:], labels[:n]))
            labels = labels[n:]
    shown = {u: [[item for item, _ in s] for _, s in requests] for u, requests in REQUESTS.items()}
    expected = []
    for user, requests in REQUESTS.items():  # the requests before the split's time, after the user's first
        for k, (_, impressions) in enumerate(requests[1:3], start=1):
            history = [item for earlier in shown[user][:k] for item in earlier]
            expected.append((user, history, [i for i, _ in impressions], [float(c) for _, c in impressions]))
    assert sorted(samples) == sorted(expected)
    scored = []
    for batch in dm.test_dataloader():
        tokens = per_sequence(batch, dm.item_map.decode(batch.sequence_ids["item_id"].values().numpy()))
        for b, user in enumerate(dm.user_map.decode(batch.labels["user"].numpy()).tolist()):
            scored.append((int(user), tokens[b][:-1], tokens[b][-1]))
    # each user's last request (time 3): the first impression validates, the later ones are tested
    expected = [
        (user, [item for earlier in shown[user][:3] for item in earlier], item)
        for user in REQUESTS
        for item in shown[user][3][1:]
    ]
    assert sorted(scored) == sorted(expected)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"task": "retrieval"}, r"^data\.columns\.request: groups impressions into requests; it needs data\.task"),
        (
            {"source": "ml-100k", "task": "ranking", "ranking": {"candidates": "impressions", "tasks": TASKS}},
            r"^data\.columns\.request: only the csv and parquet sources read a request column \(got source 'ml-100k'\)",
        ),
    ],
)
def test_a_request_column_is_refused_where_it_cannot_group_impressions(data, message):
    with pytest.raises(ValueError, match=message):
        DataConfig.from_dict({"source": "csv", "path": "x.csv", "columns": REQUEST_COLUMNS, **data})


def test_gr_data_prepare_carries_request_ids_and_a_run_on_them_takes_raw_readings_samples(
    requests_file, tmp_path, capsys
):
    from gr.commands import cli

    recipe = tmp_path / "recipe.yaml"
    data = {
        "source": requests_file.suffix[1:],
        "path": str(requests_file),
        "task": "ranking",
        "max_seq_len": 20,
        "batch_size": 8,
        "columns": REQUEST_COLUMNS,
        "ranking": {**IMPRESSIONS, "positives_per_sample": 3, "samples_per_user": 5, "tasks": TASKS},
        "split": "time",
        "split_time": 3,
        "test_events": "all",
    }
    recipe.write_text(yaml.safe_dump({"data": data}))
    assert cli.main(["data", "prepare", "--config", str(recipe), "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'out'}: 2 users, 17 items, 17 interactions")
    raw, prepared = SequenceDataModule(data), SequenceDataModule({**data, "prepared": str(tmp_path / "out")})
    raw.setup()
    prepared.setup()
    for split in ("train", "val", "test"):
        expected = [batch_samples(batch) for batch in getattr(raw, f"{split}_dataloader")()]
        assert [batch_samples(batch) for batch in getattr(prepared, f"{split}_dataloader")()] == expected, split


def batch_samples(batch):
    """(sequences' items, candidates per sequence, labels) of a batch."""
    items = per_sequence(batch, batch.sequence_ids["item_id"].values())
    return items, batch.num_targets.tolist(), batch.labels["click"].tolist()
