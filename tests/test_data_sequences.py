"""Per-user sequences: filtering, id remapping, stable time order, leave-one-out, negative sampling."""

import logging

import numpy as np
import pytest

from gr.data.interactions import DataFormatError, Interactions
from gr.data.mappings import IdMap, load_mappings, save_mappings
from gr.data.sampling import UnseenSampler
from gr.data.sequences import build_sequences, window_starts
from gr.jagged_rows import concat_ranges


def events(rows, ratings=True):
    users, items, times = (np.array(c) for c in zip(*rows))
    return Interactions(
        users, items, times.astype(np.int64), np.arange(len(rows), dtype=np.float32) if ratings else None, source="mem"
    )


def test_sort_is_by_time_with_ties_in_file_order_and_ids_are_remapped():
    data = events([("b", 30, 5), ("a", 10, 9), ("b", 20, 5), ("b", 40, 1), ("a", 20, 7), ("a", 30, 8)])
    seqs, users, items = build_sequences(data)
    assert users.raw.tolist() == ["a", "b"] and items.raw.tolist() == [10, 20, 30, 40]
    assert seqs.offsets.tolist() == [0, 3, 6]
    # user a: times 9, 7, 8 -> items 20, 30, 10; user b: 40 (t=1), then the tie at t=5 keeps file order 30, 20
    assert items.decode(seqs.items).tolist() == [20, 30, 10, 40, 30, 20]
    assert seqs.timestamps.tolist() == [7, 8, 9, 1, 5, 5]
    assert seqs.ratings.tolist() == [4, 5, 1, 3, 0, 2]


def test_short_users_are_dropped_with_a_warning_saying_how_many_and_which_key(caplog):
    data = events([(1, 1, 1), (1, 2, 2), (1, 3, 3), (2, 1, 1), (3, 4, 1), (3, 5, 2), (3, 6, 3)])
    with caplog.at_level(logging.WARNING):  # what the command line shows
        seqs, users, items = build_sequences(data, min_seq_len=3)
    assert users.raw.tolist() == [1, 3]
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.message.endswith(": dropped 1 of 3 users with fewer than 3 interactions (data.min_seq_len)")
    assert items.raw.tolist() == [1, 2, 3, 4, 5, 6]
    with pytest.raises(DataFormatError, match=r"mem: no user has at least 4 interactions \(data.min_seq_len\)"):
        build_sequences(data, min_seq_len=4)


def test_rare_items_are_dropped_before_users():
    data = events([(1, 1, 1), (1, 2, 2), (1, 9, 3), (1, 3, 4), (2, 1, 1), (2, 2, 2), (2, 3, 3)])
    seqs, users, items = build_sequences(data, min_seq_len=3, min_item_interactions=2)
    assert items.raw.tolist() == [1, 2, 3]
    assert seqs.lengths.tolist() == [3, 3]


def test_leave_one_out_targets_and_training_part():
    seqs, _, _ = build_sequences(events([(1, i, i) for i in range(5)] + [(2, i, i) for i in range(3)]))
    assert [t.tolist() for t in seqs.targets("test")] == [[0, 1], [4, 7]]
    assert [t.tolist() for t in seqs.targets("val")] == [[0, 1], [3, 6]]
    assert seqs.train_ends().tolist() == [3, 6]
    with pytest.raises(ValueError, match="split"):
        seqs.targets("train")


def test_ranges_and_windows_keep_the_most_recent_rows():
    assert concat_ranges(np.array([5, 0, 9]), np.array([2, 0, 3])).tolist() == [5, 6, 9, 10, 11]
    assert window_starts(np.array([0, 10]), np.array([8, 12]), 3).tolist() == [5, 10]


def test_sampled_negatives_are_unseen_and_distinct_per_row():
    rng = np.random.default_rng(0)
    rows = [(u, i, i) for u in range(20) for i in rng.choice(30, size=20, replace=False)]
    seqs, _, _ = build_sequences(events(rows))
    sampler = UnseenSampler(seqs)
    users = np.repeat(np.arange(20), 3)
    negatives = sampler.sample(users, 10, np.random.default_rng(1))
    assert negatives.shape == (60, 10)
    for user, row in zip(users, negatives):
        seen = set(seqs.items[seqs.offsets[user] : seqs.offsets[user + 1]].tolist())
        assert len(set(row.tolist())) == 10 and not seen & set(row.tolist())
    with pytest.raises(ValueError, match=r"data.ranking.num_negatives: 11 negatives .* only 10 unseen"):
        sampler.check_room(11, "data.ranking.num_negatives")


def test_id_maps_round_trip_through_files(tmp_path):
    maps = {
        "users": IdMap.of(np.array(["b", "a\tx", "c"])),
        "items": IdMap.of(np.array([30, 10])),
        "user_age": IdMap.of(np.array([25, 18]), offset=1),
    }
    save_mappings(str(tmp_path), maps, {"item_genres": ["Action", "Drama"]})
    loaded, columns = load_mappings(str(tmp_path))
    assert loaded["users"].raw.tolist() == ["a\tx", "b", "c"]
    assert loaded["items"].encode(np.array([10, 30])).tolist() == [0, 1]
    assert loaded["user_age"].encode(np.array([18, 99]), unknown=0).tolist() == [1, 0]
    assert columns == {"item_genres": ["Action", "Drama"]}
    assert (tmp_path / "items.tsv").read_text().splitlines() == ["dense_id\traw_id", "0\t10", "1\t30"]
    with pytest.raises(KeyError, match="not in the mapping"):
        loaded["items"].encode(np.array([20]))


def test_an_extended_id_map_keeps_every_known_id_and_appends_new_ones_through_files(tmp_path):
    old = IdMap.of(np.array([30, 10, 20]), offset=1)
    grown = old.extended(np.array([25, 10, 5, 25]))
    assert grown.raw.tolist() == [10, 20, 30, 5, 25]  # renumbers nothing
    assert grown.encode(np.array([10, 20, 30, 5, 25, 7]), unknown=0).tolist() == [1, 2, 3, 4, 5, 0]
    assert grown.decode(np.array([4, 1])).tolist() == [5, 10]
    save_mappings(str(tmp_path), {"items": grown}, {})
    loaded = load_mappings(str(tmp_path))[0]["items"]
    assert loaded.raw.tolist() == grown.raw.tolist() and loaded.encode(np.array([5])).tolist() == [4]
    with pytest.raises(ValueError, match=r"^new\.csv: column 'item': the data's ids are strings, those of the map "):
        old.extended(np.array(["x"]), "new.csv: column 'item'")
    with pytest.raises(ValueError, match=r"^the new ids: the data's ids are strings, those of .*items\.tsv \(the"):
        loaded.extended(np.array(["x"]))  # a map read from a file names it


@pytest.mark.parametrize(
    "rows, message",
    [
        ("0\t10\n1\t99999999999999999999\n", r"items\.tsv:3: raw_id: expected an int64 \(raw_type int\), got '9999"),
        ("0\t10\n1\tten\n", r"items\.tsv:3: raw_id: expected an int64 \(raw_type int\), got 'ten'"),
        ("0\t10\n1\t20\n2\t10\n", r"items\.tsv:4: raw_id 10 repeats line 2"),
        ("0\t10\n2\t20\n", r"items\.tsv:3: expected dense_id 1<TAB>raw_id"),
        ("0\t10\n01\t20\n", r"items\.tsv:3: expected dense_id 1<TAB>raw_id"),
        ("0\t10\n+1\t20\n", r"items\.tsv:3: expected dense_id 1<TAB>raw_id"),
        ("0\t10\n\n1\t20\n", r"items\.tsv:3: expected dense_id 1<TAB>raw_id"),
        ("0\t10\n1\t+20\n", r"items\.tsv:3: raw_id: expected an int64 \(raw_type int\), got '\+20'"),
        ("0\t10\n1\t20\t30\n", r"items\.tsv:3: expected dense_id 1<TAB>raw_id"),
    ],
)
def test_id_maps_that_would_map_wrongly_are_refused_naming_file_and_line(tmp_path, rows, message):
    save_mappings(str(tmp_path), {"items": IdMap.of(np.array([10, 20]))}, {})
    (tmp_path / "items.tsv").write_text("dense_id\traw_id\n" + rows)
    with pytest.raises(ValueError, match=message):
        load_mappings(str(tmp_path))


def test_id_maps_read_in_bulk_equal_those_read_line_by_line(tmp_path):
    from gr.data.mappings import _read_map_by_line

    rng = np.random.default_rng(0)
    maps = {
        "items": IdMap.of(rng.integers(-(2**63), 2**63 - 1, 500)).extended(np.array([7, -3])),
        "users": IdMap.of(np.array([f"u{k}" for k in range(300)] + ["", "é", "a b"])),
        "quoted": IdMap.of(np.array(['say "hi"', "two\nlines", "tab\there", "cr\rhere"])),
        "age": IdMap.of(np.array([30, 20]), offset=1),
    }
    save_mappings(str(tmp_path), maps, {})
    loaded, _ = load_mappings(str(tmp_path))
    for name, kind in (("items", "int"), ("users", "str"), ("quoted", "str"), ("age", "int")):
        by_line = _read_map_by_line(tmp_path / f"{name}.tsv", kind, maps[name].offset)
        assert loaded[name].raw.tolist() == by_line.raw.tolist() == maps[name].raw.tolist()
        assert loaded[name].raw.dtype.kind == by_line.raw.dtype.kind and loaded[name].offset == maps[name].offset


def test_windows_drop_the_oldest_events_in_whole_eviction_blocks():
    from gr.data.sequences import window_starts
    from gr.jagged_rows import evicted_prefix

    begins, ends = np.array([0, 10, 100, 7]), np.array([5, 30, 109, 16])
    assert window_starts(begins, ends, 8).tolist() == [0, 22, 101, 8]  # block 1: the most recent 8
    assert window_starts(begins, ends, 8, 4).tolist() == [0, 22, 104, 11]  # 12, 1 -> 4, 1 -> 4 dropped
    assert [evicted_prefix(n, 8, 4) for n in (8, 9, 12, 13)] == [0, 4, 4, 8]
