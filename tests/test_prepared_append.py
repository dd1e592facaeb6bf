"""``gr data prepare --append``: a partition of later events added to a prepared dataset reads as the
whole log prepared at once, rewrites none of its files, is recorded in the manifest, and refuses
another config, schema or earlier events in one line; ``data.since_append`` reads only its shards."""

import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from test_prepared_stream import EVENTS_HEADER, USERS, by_user, data_config, event_row, in_order, prepare

import gr.data.prepared.duckdb_append as duckdb_append
import gr.data.prepared.manifest as prepared_format
import gr.data.prepared.reader as prepared_reader
from gr.commands import cli
from gr.data.datamodule import SequenceDataModule
from gr.data.mappings import load_mappings
from gr.data.prepared.duckdb_append import append_with_duckdb
from gr.data.prepared.manifest import MANIFEST, MAPS, read_manifest
from gr.data.sequences import SPLITS
from gr.train import train
from gr.train.config import TrainConfig
from gr.utils.checksums import file_sha256
from gr.utils.run_lock import RunLockedError, output_lock
from helpers.request_log import request_data, request_rows, request_samples, write_request_log
from helpers.runs import RETRIEVAL, ratings_csv, with_overrides

DAY = 1_003_000  # the first append's events are from here on, the second's from NEXT_DAY
NEXT_DAY = 1_005_000
PER_SHARD = 25


def event_lines(users, items, start: int, end: int, seed: int) -> list:
    """CSV rows of ``users`` (numbers) with 3 to 11 events each in [start, end) of ``items`` (numbers):
    every feature kind, each user's and item's features fixed by its number, so a key's last row is
    its first; user ``u`` is ``u{u:02d}`` and item ``i`` is ``7 i``, so higher numbers sort after."""
    rng = np.random.default_rng(seed)
    lines = []
    for u in users:
        times = np.sort(rng.integers(start, end, size=int(rng.integers(3, 12))))
        for k, stamp in enumerate(times):
            lines.append(event_row(rng, f"u{u:02d}", u, int(rng.choice(items)), int(stamp), k))
    return lines


def write(path: Path, *parts: list) -> Path:
    path.write_text("\n".join([EVENTS_HEADER, *(line for part in parts for line in part)]) + "\n")
    return path


@pytest.fixture(scope="module")
def log(tmp_path_factory) -> dict:
    """The month (users 0-59, items 0-49), a day after it (every third user and 10 new users, 10 new
    items) and the next day (new users 70-74), as CSV files, and the whole log in one."""
    root = tmp_path_factory.mktemp("log")
    month = event_lines(range(60), range(50), 1_000_000, DAY, seed=0)
    day = event_lines([*range(0, 60, 3), *range(60, 70)], range(60), DAY, NEXT_DAY, seed=1)
    next_day = event_lines([*range(1, 60, 4), 61, *range(70, 75)], range(60), NEXT_DAY, 1_006_000, seed=2)
    return {
        "month": write(root / "month.csv", month),
        "day": write(root / "day.csv", day),
        "next_day": write(root / "next_day.csv", next_day),
        "month_and_day": write(root / "month_and_day.csv", month, day),
        "everything": write(root / "everything.csv", month, day, next_day),
    }


@pytest.fixture(scope="module")
def month(log, tmp_path_factory) -> Path:
    """The month prepared (3 shards); copied by each test that appends to it."""
    return prepare(data_config(log["month"]), tmp_path_factory.mktemp("month") / "dir", users_per_shard=PER_SHARD)


@pytest.fixture
def prepared_month(month) -> Callable[[Path], Path]:
    """out -> a copy of the prepared month there (files' bytes and times kept)."""
    return lambda out: Path(shutil.copytree(month, out))


@pytest.fixture(scope="module")
def appended(month, log, tmp_path_factory) -> Path:
    """The month prepared, then the day appended."""
    out = Path(shutil.copytree(month, tmp_path_factory.mktemp("appended") / "dir"))
    append_with_duckdb(out, log["day"], threads=1, users_per_shard=PER_SHARD)
    return out


@pytest.fixture(scope="module")
def at_once(log, tmp_path_factory) -> Path:
    """The month and the day prepared at once."""
    out = tmp_path_factory.mktemp("at_once") / "dir"
    return prepare(data_config(log["month_and_day"]), out, users_per_shard=PER_SHARD)


def module(prepared: Path, **overrides) -> SequenceDataModule:
    found = SequenceDataModule({**data_config(prepared), "prepared": str(prepared), **overrides})
    found.setup()
    return found


def files_of(directory: Path) -> dict:
    """{relative path: (sha256, mtime in ns)} of every file under ``directory``."""
    return {
        path.relative_to(directory).as_posix(): (file_sha256(path), path.stat().st_mtime_ns)
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def test_an_append_reads_as_the_whole_log_prepared_at_once(appended, at_once):
    """Maps, side features and every user's samples of every split are those of the month and the day
    prepared together (the new ids sort after the old, so even the dense ids agree)."""
    mine, theirs = (
        module(appended, split="time", split_time=1_004_000),
        module(at_once, split="time", split_time=1_004_000),
    )
    for name, ids in theirs.id_maps().items():
        assert np.array_equal(mine.id_maps()[name].raw, ids.raw), name
    assert mine.feature_spec() == theirs.feature_spec()
    assert mine.summary["users"] == theirs.summary["users"] == 70
    assert mine.summary["interactions"] == theirs.summary["interactions"]
    for name in SPLITS:
        expected = by_user(getattr(theirs, f"{name}_dataloader")(), 0)
        assert by_user(getattr(mine, f"{name}_dataloader")(), 0) == expected, name
        assert len(expected) > 10


@pytest.mark.parametrize("split", [{}, {"split": "time", "split_time": 120, "test_events": "all"}])
def test_an_append_keeps_request_ids_and_reads_as_the_whole_log_prepared_at_once(tmp_path, split):
    """``data.columns.request``: the request ids of the appended events join the users' stored ones, so
    a request the append continues (same id) stays one request, as preparing everything at once reads it."""
    month = request_rows(range(20), 0, 100, seed=7)
    day = request_rows(range(0, 24, 2), 100, 150, seed=8)  # every other user, and two new ones
    last = {row[0]: row[4] for row in month}
    first = {}
    for row in day:
        first.setdefault(row[0], row[4])
    assert any(last.get(user) == request for user, request in first.items())  # continued over the append
    logs = [
        write_request_log(tmp_path / f"{name}.csv", *parts) for name, parts in [("m", [month]), ("md", [month, day])]
    ]
    appended = prepare(request_data(logs[0]), tmp_path / "appended", users_per_shard=6)
    append_with_duckdb(appended, write_request_log(tmp_path / "d.csv", day), threads=1, users_per_shard=6)
    at_once = prepare(request_data(logs[1]), tmp_path / "at_once", users_per_shard=6)
    mine, theirs = (
        SequenceDataModule({**request_data(logs[1], **split), "prepared": str(d)}) for d in (appended, at_once)
    )
    mine.setup()
    theirs.setup()
    for name in SPLITS:
        expected = request_samples(getattr(theirs, f"{name}_dataloader")())
        assert request_samples(getattr(mine, f"{name}_dataloader")()) == expected and len(expected) > 10, name


def test_an_append_rewrites_no_file_and_records_itself_in_the_manifest(log, prepared_month, tmp_path):
    out = prepared_month(tmp_path / "dir")
    before, manifest_before = files_of(out), read_manifest(out)
    manifest = append_with_duckdb(out, log["day"], threads=1, users_per_shard=PER_SHARD)
    after = files_of(out)
    kept = {path: value for path, value in after.items() if path in before and path != MANIFEST}
    assert kept == {path: value for path, value in before.items() if path != MANIFEST}  # same bytes, same mtime
    assert read_manifest(out).to_dict() == manifest.to_dict()
    assert manifest.shards == manifest_before.shards and manifest.files == manifest_before.files
    (entry,) = manifest.appends
    assert (entry.path, entry.partition, entry.rows_read, entry.events) == ("appends/00001", str(log["day"]), 219, 219)
    assert (entry.users_added, entry.items_added) == (10, 10)
    assert DAY <= entry.first_timestamp <= entry.last_timestamp < NEXT_DAY
    new_files = {path for path in after if path not in before}
    listed = {shard.path for shard in entry.shards} | set(entry.files)
    assert new_files == listed and all(after[path][0] == manifest.checksum(path) for path in listed)
    assert sum(shard.users for shard in entry.shards) == 30  # every third known user and 10 new ones
    assert manifest.summary["users"] == 70 and manifest.summary["rows_read"] == 664


def test_known_ids_keep_theirs_and_new_ones_are_appended_in_sorted_order(log, prepared_month, tmp_path):
    """The next day's new users (u61 known, u70-u74 new) follow the day's: dense ids never move."""
    out = prepared_month(tmp_path / "dir")
    append_with_duckdb(out, log["day"], threads=1)
    first, _ = load_mappings(str(out / "appends/00001" / MAPS))
    append_with_duckdb(out, log["next_day"], threads=1)
    second, _ = load_mappings(str(out / "appends/00002" / MAPS))
    for name, ids in first.items():
        assert np.array_equal(second[name].raw[: len(ids.raw)], ids.raw), name
    assert second["users"].raw[70:].tolist() == [f"u{u}" for u in range(70, 75)]


def test_a_second_append_supersedes_a_users_rows_and_reads_as_everything_at_once(log, prepared_month, tmp_path):
    out = prepared_month(tmp_path / "dir")
    append_with_duckdb(out, log["day"], threads=1, users_per_shard=PER_SHARD)
    append_with_duckdb(out, log["next_day"], threads=1, users_per_shard=PER_SHARD)
    everything = prepare(data_config(log["everything"]), tmp_path / "everything", users_per_shard=PER_SHARD)
    mine, theirs = module(out), module(everything)
    for name in SPLITS:
        assert by_user(getattr(mine, f"{name}_dataloader")(), 0) == by_user(getattr(theirs, f"{name}_dataloader")(), 0)


@pytest.fixture
def opened(monkeypatch) -> list:
    """Every file the prepared reader opens as Parquet or hashes (its checksum), as it names it."""
    found: list = []
    parquet_file, sha256 = prepared_reader.pq.ParquetFile, prepared_format.file_sha256

    def opening(path, *args, **kwargs):
        found.append(Path(path))
        return parquet_file(path, *args, **kwargs)

    def hashing(path):
        found.append(Path(path))
        return sha256(path)

    monkeypatch.setattr(prepared_reader.pq, "ParquetFile", opening)
    monkeypatch.setattr(prepared_format, "file_sha256", hashing)
    return found


def shard_files(opened: list, directory: Path) -> set:
    """The shards among ``opened``, relative to ``directory``."""
    return {path.relative_to(directory).as_posix() for path in opened if path.parent.name == "shards"}


@pytest.mark.parametrize("task", ["retrieval", "ranking"])
def test_a_warm_start_since_the_append_reads_only_its_shards_and_takes_the_batches_of_everything_at_once(
    appended, at_once, opened, task
):
    """data.since_append 1 (data.train_start: the day's first event) opens the day's shards alone, and
    takes the batches, in order, of a warm start from the month's maps on the log prepared at once
    with that train start: every epoch's training batches, and validation and test."""
    base = {name: ids for name, ids in load_mappings(str(appended / MAPS))[0].items() if name != "users"}
    split = {"split": "time", "split_time": 1_004_000, "shuffle_buffer": USERS, "task": task}
    entry = read_manifest(appended).appends[0]
    mine = SequenceDataModule(
        {**data_config(appended), "prepared": str(appended), "since_append": 1, **split}, base_maps=base
    )
    mine.setup()
    assert shard_files(opened, appended) == {shard.path for shard in entry.shards}
    assert len(entry.shards) < len(read_manifest(appended).shards_since())
    theirs = SequenceDataModule(
        {**data_config(at_once), "prepared": str(at_once), "train_start": entry.first_timestamp, **split},
        base_maps=base,
    )
    theirs.setup()
    for name in SPLITS:
        loaders = [getattr(found, f"{name}_dataloader")() for found in (theirs, mine)]
        for epoch in (0, 1) if name == "train" else (0,):
            for loader in loaders:
                loader.set_epoch(epoch)
            expected = in_order(loaders[0], sampled=name == "train")
            assert in_order(loaders[1], sampled=name == "train") == expected, (name, epoch)
            assert len(expected) > 1


def test_since_append_refuses_an_earlier_train_start_an_unknown_append_and_raw_data(appended, log):
    entry = read_manifest(appended).appends[0]
    first = entry.first_timestamp
    with pytest.raises(
        ValueError, match=rf"^data\.train_start: with data\.since_append 1 expected at or after .*, {first} "
    ):
        module(appended, since_append=1, split="none", train_start=DAY - 1)
    with pytest.raises(ValueError, match=r"^data\.since_append: .*manifest\.json records 1 appends, got 2$"):
        module(appended, since_append=2)
    raw = SequenceDataModule({**data_config(log["month"]), "since_append": 1})
    with pytest.raises(ValueError, match=r"^data\.since_append: reads the shards of a prepared dataset's appends"):
        raw.setup()


def run_append(capsys, out: Path, partition: Path, *flags: str) -> tuple:
    """``gr data prepare --append`` -> (exit status, stdout, its error: the last line of stderr, after
    the stages' log lines)."""
    capsys.readouterr()
    status = cli.main(["data", "prepare", "--append", str(partition), "--out", str(out), "--threads", "1", *flags])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return status, captured.out, (captured.err.splitlines() or [""])[-1]


def test_gr_data_prepare_append_prints_what_it_added(log, prepared_month, tmp_path, capsys):
    out = prepared_month(tmp_path / "dir")
    status, printed, _ = run_append(capsys, out, log["day"])
    assert status == 0
    assert printed == (
        f"{out}: append 1 (appends/00001): 219 events, 10 new users, 10 new items, 30 users in 1 shards; "
        "now 70 users, 60 items, 664 interactions\n"
    )


def test_bad_appends_are_one_line_and_leave_the_dataset_as_it_was(log, prepared_month, tmp_path, capsys):
    out = prepared_month(tmp_path / "dir")
    before = files_of(out)
    recipe = tmp_path / "recipe.yaml"
    columns = data_config(out)["columns"]
    recipe.write_text(f"data:\n  source: csv\n  path: elsewhere.csv\n  columns: {columns}\n  min_seq_len: 4\n")
    lines = ["1003" + line[3:] for line in event_lines([3], range(5), DAY, NEXT_DAY, seed=3)]
    integers = write(tmp_path / "integers.csv", lines)
    cases = [
        (
            (log["day"], "--config", str(recipe)),
            "prepared for another data config (data.min_seq_len differs: prepared with 3, this config has 4)",
        ),
        ((log["day"], "--data.min_seq_len", "4"), "data.min_seq_len differs: prepared with 3, this config has 4"),
        ((log["month"],), "not after the dataset's last event"),
        ((integers,), "column 'user_id': integers, the dataset's users are strings (append events of its schema)"),
        ((log["day"], "--engine", "spark"), "--append: the duckdb engine appends (got --engine spark)"),
        ((log["day"], "--overwrite"), "--append adds to DIR, --overwrite replaces it: give one"),
    ]
    for arguments, message in cases:
        status, _, error = run_append(capsys, out, *arguments)
        assert status == 2 and error.startswith("gr data prepare: error: ") and message in error, (arguments, error)
    assert files_of(out) == before
    status, _, error = run_append(capsys, tmp_path / "missing", log["day"])
    missing = tmp_path / "missing"
    assert status == 2
    assert error == f"gr data prepare: error: {missing}: no such directory (--out: the prepared dataset to append to)"


def test_a_crash_before_the_manifest_leaves_the_dataset_as_it_was_and_the_next_append_completes(
    log, prepared_month, tmp_path, monkeypatch
):
    out = prepared_month(tmp_path / "dir")
    before = files_of(out)

    def crash(directory, manifest):
        raise KeyboardInterrupt

    monkeypatch.setattr(duckdb_append, "write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        append_with_duckdb(out, log["day"], threads=1)
    assert (out / "appends/00001").is_dir()  # written whole, but no manifest lists it
    assert {path: v for path, v in files_of(out).items() if not path.startswith("appends/")} == before
    assert not read_manifest(out).appends
    monkeypatch.undo()
    manifest = append_with_duckdb(out, log["day"], threads=1, users_per_shard=PER_SHARD)
    assert [entry.path for entry in manifest.appends] == ["appends/00001"]
    assert module(out).summary["users"] == 70


@pytest.mark.slow
def test_gr_train_warm_starts_on_the_appended_day_reading_only_its_shards(tmp_path, opened):
    """A run trained on the prepared month, then ``--init-from`` it with ``data.since_append 1``:
    the warm start trains (from the run's maps) on the day's shards alone."""
    events = ratings_csv(tmp_path / "events.csv").read_text().splitlines()
    stamps = np.array([int(line.split(",")[2]) for line in events[1:]])
    cut = int(np.quantile(stamps, 0.9))
    month = tmp_path / "month.csv"
    month.write_text("\n".join([events[0], *(e for e, t in zip(events[1:], stamps) if t < cut)]) + "\n")
    day = tmp_path / "day.csv"
    day.write_text("\n".join([events[0], *(e for e, t in zip(events[1:], stamps) if t >= cut)]) + "\n")
    values = with_overrides(RETRIEVAL, ("trainer.max_epochs", 1))
    values["data"].update(source="csv", path=str(month), columns={"rating": "rating"})
    prepared = prepare(values["data"], tmp_path / "prepared", users_per_shard=55)
    values["data"]["prepared"] = str(prepared)
    train(TrainConfig.from_dict(values), tmp_path / "day0")
    entry = append_with_duckdb(prepared, day, threads=1, users_per_shard=55).appends[0]
    opened.clear()
    warm = with_overrides(
        values,
        ("trainer.init_from", str(tmp_path / "day0")),
        ("data.since_append", 1),
        ("data.split", "none"),
        ("trainer.early_stopping_patience", 0),
    )
    metrics = train(TrainConfig.from_dict(warm), tmp_path / "day1")
    assert shard_files(opened, prepared) == {shard.path for shard in entry.shards}
    assert len(read_manifest(prepared).shards) == 3 and metrics["init_from"]["run"] == str(tmp_path / "day0")


def test_an_append_to_a_dataset_another_writer_holds_is_refused_before_anything_is_written(
    log, prepared_month, tmp_path
):
    out = prepared_month(tmp_path / "dir")
    before = files_of(out)
    with output_lock(out, "gr data prepare --overwrite"), pytest.raises(RunLockedError, match=str(out)):
        append_with_duckdb(out, log["day"], threads=1)
    assert files_of(out) == before
