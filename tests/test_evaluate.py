"""``gr evaluate RUN|EXPORT``: a run's test metrics recomputed from its best checkpoint equal
its metrics.json, and its export scored through the serving runtime reaches the same metrics
(retrieval and ranking), written as JSON; on later data a run keeps its ids and leaves out the
items it has no row for; bad invocations are one clear line. The run's item
popularity reaches its export, which answers an empty history with the most popular items."""

import csv
import json
import shutil

import numpy as np
import pytest
import torch
import yaml

from gr.commands.cli import main as gr_main
from gr.commands.evaluate import default_output, evaluate_export, evaluate_run
from gr.data.config import SyntheticConfig
from gr.data.datamodule import SequenceDataModule
from gr.data.mappings import model_maps
from gr.data.popularity import POPULARITY_FILE, load_popularity
from gr.data.synthetic import generate_synthetic
from gr.export.manifest import MANIFEST
from gr.export.popularity import POPULARITY
from gr.export.writer import export_run
from gr.serving import Ranker, RecommendRequest
from gr.train import load_config, load_trained_model, train
from gr.train.run_files import CONFIG_FILE, MAPPINGS_DIR
from gr.train.tasks import RetrievalTask
from helpers.runs import RANKING, RETRIEVAL, config

RETRIEVAL_KEYS = ("hr@5", "ndcg@5", "hr@10", "ndcg@10", "mrr")
RANKING_KEYS = ("auc", "gauc", "logloss", "auc/watch", "gauc/watch", "logloss/watch")


@pytest.fixture(scope="module")
def retrieval(tmp_path_factory):
    out = tmp_path_factory.mktemp("evaluate") / "run"
    metrics = train(config(RETRIEVAL, ("trainer.max_epochs", 1)), out)
    return out, export_run(out, out.parent / "export"), metrics


@pytest.fixture(scope="module")
def ranking(tmp_path_factory):
    out = tmp_path_factory.mktemp("evaluate") / "run"
    metrics = train(config(RANKING, ("trainer.max_epochs", 1)), out)
    return out, export_run(out, out.parent / "export"), metrics


@pytest.fixture(scope="module")
def next_event(tmp_path_factory):
    """A retrieval run whose queries read the time of the event after each token ("next_event")."""
    out = tmp_path_factory.mktemp("evaluate") / "run"
    train(config(RETRIEVAL, ("trainer.max_epochs", 1), ("model.hstu.query_time", "next_event")), out)
    return out, export_run(out, out.parent / "export")


def evaluate(capsys, *argv):
    capsys.readouterr()  # what the fixtures' training printed
    assert gr_main(["evaluate", *map(str, argv)]) == 0
    printed = capsys.readouterr().out
    assert "wrote " in printed.splitlines()[-1]
    return json.loads(printed.rsplit("wrote ", 1)[0])


@pytest.mark.parametrize("which, keys", [("retrieval", RETRIEVAL_KEYS), ("ranking", RANKING_KEYS)])
def test_run_and_its_export_reach_the_runs_test_metrics(which, keys, request, capsys, tmp_path):
    run, export, trained = request.getfixturevalue(which)
    from_run = evaluate(capsys, run)
    assert json.loads(default_output(run).read_text())["source"] == {"run": str(run)}
    served = evaluate(capsys, export, "--config", run / "config.yaml", "--output", tmp_path / "served.json")
    written = json.loads((tmp_path / "served.json").read_text())
    assert {k: v for k, v in written.items() if k != "data"} == served and written["data"]["users"] > 0
    for key in keys:
        assert from_run[key] == pytest.approx(trained[key], abs=1e-6), key
        assert served[key] == pytest.approx(trained[key], abs=1e-5), key
    if which == "retrieval":
        assert served["popularity"] == pytest.approx(trained["popularity"], abs=1e-9)


def test_a_run_evaluated_on_data_with_a_new_item_keeps_its_ids_and_leaves_the_new_items_events_out(
    retrieval, capsys, tmp_path
):
    """The run's own events as a CSV, plus history events of an item it never saw whose raw id sorts
    before every other: read with maps of their own, every item would move up one row."""
    run, export, trained = retrieval
    data = generate_synthetic(SyntheticConfig(**RETRIEVAL["data"]["synthetic"]), seed=0)
    new_item = int(data.items.min()) - 1
    firsts = {}
    for user, timestamp in zip(data.users.tolist(), data.timestamps.tolist()):
        firsts[user] = min(timestamp, firsts.get(user, timestamp))
    added = [(user, new_item, first - 1) for user, first in list(firsts.items())[::4]]  # history, never a target
    rows = [*zip(data.users.tolist(), data.items.tolist(), data.timestamps.tolist()), *added]
    later = tmp_path / "later.csv"
    later.write_text("user_id,item_id,timestamp\n" + "".join(f"{u},{i},{t}\n" for u, i, t in rows))
    on_csv = ("--data.source", "csv", "--data.path", later)
    evaluate(capsys, run, *on_csv, "--output", tmp_path / "run.json")
    evaluate(capsys, export, "--config", run / "config.yaml", *on_csv, "--output", tmp_path / "export.json")
    for written in ("run.json", "export.json"):
        evaluated = json.loads((tmp_path / written).read_text())
        assert evaluated["data"]["unknown_items"] == {"items": 1, "events": len(added)}, written
        for key in RETRIEVAL_KEYS:
            assert evaluated[key] == pytest.approx(trained[key], abs=1e-5), key


@pytest.mark.parametrize("window", [20, 12])
def test_a_next_event_models_export_reaches_the_runs_metrics_on_every_later_event(next_event, window, tmp_path):
    """Each target's query at the time of its own event (the last token's at the target's): the
    export's one pass over every test token agrees with the run's test pass, ``data.test_events: all``
    (12: windows slide)."""
    run, export = next_event
    overrides = every_later_event(tmp_path, window)
    from_run, served = evaluate_run(run, overrides), evaluate_export(export, run / CONFIG_FILE, overrides)
    assert from_run["data"]["evaluated_targets"]["test"] > from_run["data"]["evaluated_users"]["test"]
    for key in RETRIEVAL_KEYS:
        assert served[key] == pytest.approx(from_run[key], abs=1e-5), key


def test_a_new_cut_on_the_command_line_clears_the_runs_stored_end_unless_an_end_is_given(retrieval, capsys, tmp_path):
    """The run as if trained on a time split that ended: judged on a later cut past that end."""
    run, export, _ = retrieval
    timed = tmp_path / "timed"
    shutil.copytree(run, timed)
    values = yaml.safe_load((timed / "config.yaml").read_text())
    data = SequenceDataModule(values["data"])
    data.setup()
    cut, end, later = (int(np.percentile(data.corpus.sequences.timestamps, q)) for q in (50, 70, 90))
    values["data"].update(split="time", split_time=cut, split_end=end)
    (timed / "config.yaml").write_text(yaml.safe_dump(values))
    for source in ([timed], [export, "--config", timed / "config.yaml"]):
        report = evaluate(capsys, *source, "--data.split_time", later, "--output", tmp_path / "report.json")
        assert report["split"] == "test" and 0 <= report["hr@10"] <= 1
        written = json.loads((tmp_path / "report.json").read_text())
        assert written["data"]["split"] == {"kind": "time", "split_time": later, "test_events": "next"}
        assert written["data"]["evaluated_users"]["test"] > 0
    evaluate(capsys, timed, "--data.split_time", end, "--data.split_end", later, "--output", tmp_path / "report.json")
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["data"]["split"] == {"kind": "time", "split_time": end, "split_end": later, "test_events": "next"}


def test_per_user_metrics_name_each_test_user_once_and_average_to_the_reported_metrics(retrieval, capsys, tmp_path):
    run, export, _ = retrieval
    data = SequenceDataModule(load_config(run / "config.yaml").data)
    data.setup()
    users, _ = data.corpus.sequences.targets("test")
    evaluated = data.user_map.decode(np.unique(users))
    reports = {}
    for name, source in (("run", [run]), ("export", [export, "--config", run / "config.yaml"])):
        path = tmp_path / f"{name}.csv"
        reports[name] = evaluate(capsys, *source, "--output", tmp_path / f"{name}.json", "--per-user", path)
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        assert [row["user"] for row in rows] == [str(u) for u in evaluated]
        assert sum(int(row["targets"]) for row in rows) == len(users)
        for key in RETRIEVAL_KEYS:
            assert np.mean([float(row[key]) for row in rows]) == pytest.approx(reports[name][key], abs=1e-12), key
    assert reports["export"]["hr@10"] == pytest.approx(reports["run"]["hr@10"], abs=1e-5)


def per_target_metrics(run, overrides) -> dict:
    """The run's test metrics with every test target scored from a sequence of its own (no two
    neighbouring rows of a batch are one user's targets in time order, so none share a sequence)."""
    model, cfg = load_trained_model(run)
    maps = model_maps(str(run / MAPPINGS_DIR))
    data = SequenceDataModule(load_config(run / CONFIG_FILE, overrides).data, 1, maps, new_ids="unknown")
    data.setup()
    split = data.splits["test"]
    within = np.arange(len(split.users)) - np.searchsorted(split.users, split.users)  # a target's place in its user's
    order = np.lexsort((split.users, -within))  # the users' last targets first, then the ones before...
    task = RetrievalTask(cfg.task.retrieval, data.num_items, model.postfix_dnn.item_embedding)
    task.start_evaluation(model.embeddings)
    with torch.no_grad():
        for rows in np.array_split(order, max(1, len(order) // 64)):
            batch = split.build(rows, np.random.default_rng(0))
            assert len(batch.seq_offsets) - 1 == len(rows)
            task.evaluation_step(model(batch), batch)
    return task.finish_evaluation()


def every_later_event(tmp_path, window: int) -> list:
    """Data overrides: the runs' synthetic events as a CSV, each user's k-th event at second 1000 k,
    cut at 4500 (5 events before it), every later event a test target, windows of ``window``."""
    data = generate_synthetic(SyntheticConfig(**RETRIEVAL["data"]["synthetic"]), seed=0)
    starts = np.flatnonzero(np.r_[True, data.users[1:] != data.users[:-1]])  # the generator's rows: user by user
    seconds = 1000 * (np.arange(len(data.users)) - np.repeat(starts, np.diff(np.r_[starts, len(data.users)])))
    rows = zip(data.users.tolist(), data.items.tolist(), seconds.tolist())
    events = tmp_path / "events.csv"
    events.write_text("user_id,item_id,timestamp\n" + "".join(f"{u},{i},{t}\n" for u, i, t in rows))
    overrides = [("data.source", "csv"), ("data.path", str(events)), ("data.split", "time")]
    return overrides + [("data.split_time", "4500"), ("data.test_events", "all"), ("data.max_seq_len", str(window))]


@pytest.mark.parametrize("window", [20, 12])
def test_every_test_event_of_a_user_is_scored_from_one_pass_with_the_per_target_metrics(retrieval, window, tmp_path):
    """``data.test_events: all`` on the run's events, each user's k-th event at second 1000 k: every
    user has 5 events before the cut and its later ones after it. A user's targets whose windows
    start alike share one sequence (12: longer histories slide, so their targets span several); the run and
    its export reach the metrics of scoring each target from a sequence of its own."""
    run, export, _ = retrieval
    overrides = every_later_event(tmp_path, window)
    reference = per_target_metrics(run, overrides)
    from_run = evaluate_run(run, overrides)
    served = evaluate_export(export, run / CONFIG_FILE, overrides)
    users, targets = from_run["data"]["evaluated_users"]["test"], from_run["data"]["evaluated_targets"]["test"]
    assert users == RETRIEVAL["data"]["synthetic"]["num_users"] and targets > 3 * users
    for key in RETRIEVAL_KEYS:
        assert from_run[key] == pytest.approx(reference[key], abs=1e-6), key
        assert served[key] == pytest.approx(reference[key], abs=1e-6), key
    timed = SequenceDataModule(load_config(run / CONFIG_FILE, overrides).data)
    timed.setup()
    sequences = sum(len(batch.seq_offsets) - 1 for batch in timed.test_dataloader())
    if window == 20:  # every history fits: one sequence a user (two where a batch ends amid its targets)
        assert sequences < users + len(timed.test_dataloader())
    else:  # windows slide: a user's targets span several sequences
        assert users + len(timed.test_dataloader()) < sequences < targets


def test_per_user_metrics_of_a_ranking_model_are_refused_in_one_line(ranking, capsys, tmp_path):
    run, _, _ = ranking
    assert gr_main(["evaluate", str(run), "--per-user", str(tmp_path / "users.csv")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--per-user" in err and "per-user metrics are for retrieval" in err
    assert not (tmp_path / "users.csv").exists()


def test_an_export_without_config_and_model_overrides_are_refused(retrieval, capsys):
    run, export, _ = retrieval
    with pytest.raises(SystemExit):
        gr_main(["evaluate", str(export)])
    assert "--config RECIPE.yaml is needed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gr_main(["evaluate", str(run), "--model.hstu.num_layers", "3"])
    assert "only data.* keys" in capsys.readouterr().err
    assert gr_main(["evaluate", str(run / "nowhere")]) == 2
    assert "no such run or export directory" in capsys.readouterr().err


def test_the_runs_item_popularity_reaches_its_export_and_answers_an_empty_history(retrieval):
    run, export, _ = retrieval
    data = SequenceDataModule(load_config(run / "config.yaml").data)
    data.setup()
    counts = load_popularity(run / POPULARITY_FILE)
    assert counts.tolist() == data.popularity().tolist() and counts.sum() > 0
    assert load_popularity(export / POPULARITY).tolist() == counts.tolist()
    assert f"  {POPULARITY}\n" in (export / MANIFEST).read_text()
    answer = Ranker.load(export).recommend(RecommendRequest("new-user", {}, 3))
    assert (
        answer.fallback == "popularity"
        and answer.items == sorted(range(len(counts)), key=lambda i: (-counts[i], i))[:3]
    )
