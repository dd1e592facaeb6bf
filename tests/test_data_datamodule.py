"""SequenceDataModule batches follow docs DATA_CONTRACT: retrieval and ranking, every split."""

from pathlib import Path

import numpy as np
import pytest
import torch

from gr import GRModel, HSTUConfig, TableConfig
from gr.data import SequenceDataModule
from gr.data.batching import BatchPlan
from gr.jagged import lengths_from_offsets
from gr.postfix_dnn import MMoERankingHead, RetrievalHead
from gr.prefix_dnn import MLPTokenEncoder

SYNTHETIC = {"num_users": 60, "num_items": 80, "min_len": 8, "max_len": 24}
MAX_LEN = 10


def module(**overrides):
    values = {"synthetic": SYNTHETIC, "max_seq_len": MAX_LEN, "batch_size": 16, "eval_batch_size": 32, **overrides}
    dm = SequenceDataModule(values)
    dm.setup()
    return dm


def user_rows(dm, user):
    seqs = dm.corpus.sequences
    rows = slice(seqs.offsets[user], seqs.offsets[user + 1])
    return seqs.items[rows], seqs.timestamps[rows], seqs.ratings[rows]


def split_tokens(batch, values):
    offsets = batch.seq_offsets.tolist()
    return [values[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


@pytest.fixture(scope="module")
def retrieval():
    return module()


@pytest.fixture(scope="module")
def ranking():
    return module(
        task="ranking",
        ranking={"positives_per_sample": 2, "samples_per_user": 3, "num_negatives": 5, "eval_num_negatives": 7},
    )


def test_retrieval_train_batch_is_the_recent_training_part_shifted_by_one(retrieval):
    batches = list(retrieval.train_dataloader())
    assert len(batches) == 4 and sum(len(b.labels["user"]) for b in batches) == 60
    batch = batches[0]
    assert batch.num_targets is None
    assert batch.sequence_ids.keys() == ["item_id", "item_category"]
    assert batch.common_ids.keys() == ["user_age", "user_gender"]
    assert torch.equal(batch.sequence_ids["item_id"].lengths(), lengths_from_offsets(batch.seq_offsets))
    tokens = split_tokens(batch, batch.sequence_ids["item_id"].values())
    labels = split_tokens(batch, batch.labels["next_item"])
    times = split_tokens(batch, batch.timestamps)
    query_times = split_tokens(batch, batch.query_times)
    for b, user in enumerate(batch.labels["user"].tolist()):
        items, stamps, _ = user_rows(retrieval, user)
        train = items[:-2]  # leave-one-out: the last two events are held out
        assert tokens[b] == train[:-1][-MAX_LEN:].tolist()
        assert labels[b] == train[1:][-MAX_LEN:].tolist()
        assert times[b] == stamps[:-2][:-1][-MAX_LEN:].tolist()
        assert query_times[b] == stamps[:-2][1:][-MAX_LEN:].tolist()  # each label's time
    assert batch.max_seq_len == MAX_LEN  # sequences are >= 8 long, so some history is cut to the window
    categories = retrieval.corpus.item_features.categorical["item_category"]
    assert torch.equal(
        batch.sequence_ids["item_category"].values(),
        torch.from_numpy(categories[batch.sequence_ids["item_id"].values().numpy()]),
    )


@pytest.mark.parametrize("split, held_out", [("val", 2), ("test", 1)])
def test_retrieval_eval_batch_holds_out_one_event_and_excludes_the_history(retrieval, split, held_out):
    batch = next(iter(getattr(retrieval, f"{split}_dataloader")()))
    tokens = split_tokens(batch, batch.sequence_ids["item_id"].values())
    query_times = split_tokens(batch, batch.query_times)
    offsets = batch.labels["exclude_offsets"].tolist()
    for b, user in enumerate(batch.labels["user"].tolist()):
        items, stamps, _ = user_rows(retrieval, user)
        target = len(items) - held_out
        assert batch.labels["target_item"][b] == items[target]
        assert tokens[b] == items[:target][-MAX_LEN:].tolist()
        assert query_times[b] == stamps[1 : target + 1][-MAX_LEN:].tolist()  # the last: the target's time
        excluded = batch.labels["exclude_items"][offsets[b] : offsets[b + 1]].tolist()
        assert sorted(excluded) == sorted(set(items[:target].tolist()))


def test_window_exclusion_keeps_only_the_input_items_and_never_the_target(tmp_path):
    rows = ["user_id,item_id,timestamp"] + [f"1,{item},{t}" for t, item in enumerate([5, 6, 7, 8, 9, 5, 10])]
    rows += [f"2,{item},{t}" for t, item in enumerate([1, 2, 3, 4])]
    path = tmp_path / "events.csv"
    path.write_text("\n".join(rows) + "\n")
    for exclude, expected in (("history", [6, 7, 8, 9]), ("window", [7, 8, 9])):
        dm = module(source="csv", path=str(path), max_seq_len=3, eval_exclude=exclude)
        batch = next(iter(dm.val_dataloader()))  # user 1's validation target is item 5, seen before
        raw = dm.item_map.decode(batch.labels["exclude_items"][: batch.labels["exclude_offsets"][1]].numpy())
        assert dm.item_map.decode(batch.labels["target_item"][:1].numpy()).tolist() == [5]
        assert sorted(raw.tolist()) == expected


def test_ranking_train_sample_is_history_then_real_next_items_then_unseen_negatives(ranking):
    batch = next(iter(ranking.train_dataloader()))
    assert batch.num_targets.tolist() == [7] * len(batch.num_targets)
    tokens = split_tokens(batch, batch.sequence_ids["item_id"].values())
    times = split_tokens(batch, batch.timestamps)
    query_times = split_tokens(batch, batch.query_times)
    watch = batch.labels["watch"].view(-1, 7)
    like = batch.labels["like"].view(-1, 7)
    for b, user in enumerate(batch.labels["user"].tolist()):
        items, stamps, ratings = user_rows(ranking, user)
        history, candidates = tokens[b][:-7], tokens[b][-7:]
        cut = next(
            c
            for c in range(1, len(items) - 3)
            if items[max(0, c - MAX_LEN) : c].tolist() == history and items[c : c + 2].tolist() == candidates[:2]
        )
        assert cut + 2 <= len(items) - 2  # positives come from the training part only
        assert not set(candidates[2:]) & set(items.tolist()) and len(set(candidates)) == 7
        assert times[b][-7:] == [stamps[cut]] * 7
        assert query_times[b] == times[b][1:-7] + [stamps[cut]] * 8  # the request (cut) ends the history
        assert watch[b].tolist() == [1, 1, 0, 0, 0, 0, 0]
        assert like[b].tolist() == [float(r >= 4) for r in ratings[cut : cut + 2]] + [0.0] * 5


def test_ranking_eval_candidates_are_fixed_by_the_seed(ranking):
    first = next(iter(ranking.test_dataloader()))
    again = next(
        iter(
            module(
                task="ranking",
                ranking={"positives_per_sample": 2, "samples_per_user": 3, "num_negatives": 5, "eval_num_negatives": 7},
            ).test_dataloader()
        )
    )
    assert first.num_targets.tolist() == [8] * len(first.num_targets)
    assert torch.equal(first.sequence_ids.values(), again.sequence_ids.values())
    tokens = split_tokens(first, first.sequence_ids["item_id"].values())
    for b, user in enumerate(first.labels["user"].tolist()):
        items, _, _ = user_rows(ranking, user)
        assert tokens[b][-8] == items[-1] and tokens[b][:-8] == items[:-1][-MAX_LEN:].tolist()
    assert first.labels["watch"].view(-1, 8)[:, 0].eq(1).all() and first.labels["watch"].view(-1, 8)[:, 1:].eq(0).all()


def test_batches_are_seeded_and_reshuffled_per_epoch(ranking):
    other = module(
        task="ranking",
        ranking={"positives_per_sample": 2, "samples_per_user": 3, "num_negatives": 5, "eval_num_negatives": 7},
    )
    loaders = [ranking.train_dataloader(), other.train_dataloader()]
    first = [next(iter(loader)) for loader in loaders]
    assert torch.equal(first[0].sequence_ids.values(), first[1].sequence_ids.values())
    loaders[0].sampler.set_epoch(1)
    assert not torch.equal(next(iter(loaders[0])).labels["user"], first[0].labels["user"])
    reseeded = module(
        task="ranking",
        seed=1,
        ranking={"positives_per_sample": 2, "samples_per_user": 3, "num_negatives": 5, "eval_num_negatives": 7},
    )
    assert not torch.equal(next(iter(reseeded.train_dataloader())).labels["user"], first[0].labels["user"])


def test_worker_processes_give_the_same_batches(retrieval):
    config = {"synthetic": SYNTHETIC, "max_seq_len": MAX_LEN, "batch_size": 16, "num_workers": 2}
    dm = SequenceDataModule(config)
    dm.setup()
    for ours, theirs in zip(retrieval.train_dataloader(), dm.train_dataloader()):
        assert torch.equal(ours.sequence_ids.values(), theirs.sequence_ids.values())


@pytest.mark.parametrize("exclude", ["history", "window"])
def test_targets_sharing_a_sequence_each_exclude_the_distinct_items_before_them(tmp_path, exclude):
    """``test_events: all`` with repeated items: each target's exclusions are its own (its history's
    or its window's distinct items, never itself), wherever its sequence starts."""
    histories = {1: [5, 6, 7, 5, 8, 6, 9, 10, 5, 11], 2: [1, 2, 1, 3, 2, 4], 3: [7, 7, 8, 7, 9]}
    rows = ["user_id,item_id,timestamp"] + [
        f"{u},{i},{t}" for u, items in histories.items() for t, i in enumerate(items)
    ]
    path = tmp_path / "events.csv"
    path.write_text("\n".join(rows) + "\n")
    dm = module(
        source="csv", path=str(path), split="time", split_time=2, test_events="all", max_seq_len=4, eval_exclude=exclude
    )
    batch = next(iter(dm.test_dataloader()))
    seqs, offsets = dm.corpus.sequences, batch.labels["exclude_offsets"].tolist()
    users, targets = seqs.targets("test")
    assert len(batch.seq_offsets) - 1 < len(targets)  # some targets share a sequence
    for s, (user, target) in enumerate(zip(users.tolist(), targets.tolist())):
        begin = seqs.starts[user] if exclude == "history" else max(seqs.starts[user], target - 4)
        expected = sorted(set(seqs.items[begin:target].tolist()) - {int(seqs.items[target])})
        assert sorted(batch.labels["exclude_items"][offsets[s] : offsets[s + 1]].tolist()) == expected, (user, target)


def test_batch_plan_splits_each_global_batch_over_ranks_with_disjoint_rows():
    plans = [BatchPlan(103, 10, shuffle=True, seed=5, rank=r, world_size=3) for r in range(3)]
    batches = [list(plan) for plan in plans]
    assert [len(b) for b in batches] == [11, 11, 11]  # the steps of one process: ceil(103 / 10)
    assert len(list(BatchPlan(103, 10, shuffle=True, seed=5))) == 11
    rows = np.concatenate([key.rows for rank in batches for key in rank])
    assert sorted(rows.tolist()) == list(range(103))
    assert max(len(key.rows) for rank in batches for key in rank) <= 4  # ceil(10 / 3)
    with pytest.raises(ValueError, match="global batch of 2 cannot feed 3 ranks"):
        BatchPlan(103, 2, shuffle=True, seed=5, rank=0, world_size=3)


def test_an_evaluation_plan_deals_each_rank_a_contiguous_run_of_rows_and_keeps_a_group_in_one_batch():
    """A user's test targets are neighbouring rows: on one rank, in one batch, they share a sequence."""
    plans = [BatchPlan(11, 4, shuffle=False, seed=5, rank=r, world_size=2) for r in (0, 1)]
    assert [[key.rows.tolist() for key in plan] for plan in plans] == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], [10]]]
    groups = np.array([0, 0, 0, 1, 2, 2, 3, 4, 4, 4, 4, 5])  # 6 groups, batches of 4 groups over 2 ranks
    plans = [BatchPlan(12, 4, shuffle=False, seed=5, rank=r, world_size=2, groups=groups) for r in (0, 1)]
    assert [[key.rows.tolist() for key in plan] for plan in plans] == [[[0, 1, 2, 3], [4, 5]], [[6, 7, 8, 9, 10], [11]]]


def test_popularity_counts_training_parts_only(retrieval):
    expected = np.zeros(retrieval.num_items, dtype=np.int64)
    for user in range(retrieval.num_users):
        items, _, _ = user_rows(retrieval, user)
        np.add.at(expected, items[:-2], 1)
    assert retrieval.popularity().tolist() == expected.tolist()


def test_mappings_are_saved_beside_the_run_and_decode_batches(retrieval, tmp_path):
    retrieval.save_mappings(str(tmp_path / "run"))
    maps, _ = SequenceDataModule.load_mappings(str(tmp_path / "run"))
    assert {"users", "items", "item_category", "user_age", "user_gender"} <= set(maps)
    assert maps["items"].cardinality == retrieval.num_items
    assert maps["users"].decode(np.arange(3)).tolist() == [1, 2, 3]  # synthetic raw user ids are 1-based
    assert Path(tmp_path / "run" / "users.tsv").read_text().splitlines()[1] == "0\t1"


def test_real_ml_100k_feature_spec(ml_100k):
    dm = SequenceDataModule({"source": "ml-100k", "path": str(ml_100k)})
    dm.setup()
    spec = dm.feature_spec()
    assert (dm.num_users, dm.num_items) == (943, 1682)
    assert spec.sequence == {"item_id": 1682}
    assert spec.token_dense == {"item_genres": 19}
    assert spec.common == {"user_age": 8, "user_gender": 3, "user_occupation": 22}  # + "unknown" each
    assert int(dm.popularity().sum()) == 100_000 - 2 * 943


def test_ranking_rating_task_without_ratings_is_a_config_error(tmp_path):
    path = tmp_path / "events.csv"
    path.write_text("user_id,item_id,timestamp\n" + "".join(f"1,{i},{i}\n" for i in range(6)))
    dm = SequenceDataModule({"source": "csv", "path": str(path), "task": "ranking"})
    with pytest.raises(ValueError, match=r"data\.ranking\.tasks: .* has no ratings"):
        dm.setup()


def model_for(dm, postfix):
    spec = dm.feature_spec()
    tables = [TableConfig(name, cardinality, 8, (name,)) for name, cardinality in spec.sequence.items()]
    tables += [TableConfig(name, cardinality, 4, (name,), kind="common") for name, cardinality in spec.common.items()]
    prefix = MLPTokenEncoder({name: 8 for name in spec.sequence}, 16)
    config = HSTUConfig(hidden_dim=16, attention_dim=8, linear_dim=8, max_seq_len=MAX_LEN, dropout=0.0)
    return GRModel(config, prefix, postfix, tables)


def test_batches_run_through_a_model_built_from_the_feature_spec(retrieval, ranking):
    out = model_for(retrieval, RetrievalHead(16, 16))(next(iter(retrieval.val_dataloader())))
    assert out.predictions["query"].shape[0] == int(next(iter(retrieval.val_dataloader())).seq_offsets[-1])
    head = MMoERankingHead(16, list(ranking.tasks), common_dims={name: 4 for name in ranking.feature_spec().common})
    batch = next(iter(ranking.train_dataloader()))
    out = model_for(ranking, head)(batch)
    assert out.predictions["like"].shape == batch.labels["like"].shape
