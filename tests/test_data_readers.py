"""Readers of the public formats: exact layouts, side features, and errors naming file and line."""

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gr.data.config import ColumnConfig, DataConfig
from gr.data.interactions import DataFormatError
from gr.data.readers import (
    read_amazon,
    read_ml_1m,
    read_ml_20m,
    read_ml_100k,
    read_source,
    read_table_csv,
    read_table_parquet,
)


def write(path: Path, text: str, encoding: str = "utf8") -> Path:
    path.write_bytes(text.encode(encoding))
    return path


def ml_100k_dir(root: Path) -> Path:
    write(root / "u.data", "1\t10\t4\t881250949\n2\t10\t2\t881250950\n1\t30\t5\t881250000\n")
    flags = ["0"] * 19
    drama = flags.copy()
    drama[8] = "1"
    write(
        root / "u.item",
        f"10|Amélie (2001)|01-Jan-2001||http://x|{'|'.join(drama)}\n"
        f"30|Toy Story (1995)|01-Jan-1995||http://y|{'|'.join(flags)}\n",
        "latin-1",
    )
    write(root / "u.user", "1|24|M|technician|85711\n2|60|F|other|94043\n")
    return root


def test_ml_100k_reads_ratings_genres_and_bucketed_user_attributes(tmp_path):
    data = read_ml_100k(str(ml_100k_dir(tmp_path)))
    assert data.users.tolist() == [1, 2, 1]
    assert data.items.tolist() == [10, 10, 30]
    assert data.ratings.tolist() == [4.0, 2.0, 5.0]
    assert data.timestamps.tolist() == [881250949, 881250950, 881250000]
    genres = data.item_side.dense["item_genres"]
    assert genres.shape == (2, 19) and genres[0].nonzero()[0].tolist() == [8] and genres[1].sum() == 0
    assert data.user_side.categorical["user_age"].tolist() == [18, 56]  # ML-1M buckets: 18-24, 56+
    assert data.user_side.categorical["user_occupation"].tolist() == ["technician", "other"]


def test_ml_100k_release_years_are_years_from_1990_decades_before_and_unknown_when_empty(tmp_path):
    root = ml_100k_dir(tmp_path)
    flags = "|".join(["0"] * 19)
    write(
        root / "u.item",
        f"10|A (1995)|01-Jan-1995||http://x|{flags}\n30|B (1985)|12-Mar-1985||http://y|{flags}\n"
        f"20|unknown|||http://z|{flags}\n",
        "latin-1",
    )
    side = read_ml_100k(str(root), release_year=True).item_side
    assert side.keys.tolist() == [10, 30, 20]
    assert side.categorical["item_year"].tolist() == ["1995", "1980s", "unknown"]
    assert "item_year" not in read_ml_100k(str(root)).item_side.categorical  # not asked: not read


def test_ml_100k_bad_release_date_names_its_line(tmp_path):
    root = ml_100k_dir(tmp_path)
    flags = "|".join(["0"] * 19)
    write(root / "u.item", f"10|A|01-Jan-1995||x|{flags}\n30|B|1985||x|{flags}\n", "latin-1")
    with pytest.raises(DataFormatError, match=r"u\.item:2: release date '1985': expected DD-Mon-YYYY or an empty"):
        read_ml_100k(str(root), release_year=True)


def test_ml_100k_real_files_have_the_published_counts(ml_100k):
    data = read_ml_100k(str(ml_100k))
    assert len(data.users) == 100_000
    assert len(np.unique(data.users)) == 943
    assert len(np.unique(data.items)) == 1682
    assert data.item_side.dense_columns["item_genres"][:2] == ["unknown", "Action"]
    assert len(data.user_side.keys) == 943


def test_ml_1m_double_colon_layout_with_latin1_genres(tmp_path):
    write(tmp_path / "ratings.dat", "1::1193::5::978300760\n1::661::3::978302109\n2::1193::4::978298413\n")
    write(
        tmp_path / "movies.dat",
        "1193::One Flew Over the Cuckoo's Nest (1975)::Drama\n"
        "661::Café: a Story (1996)::Animation|Children's|Musical\n",
        "latin-1",
    )
    write(tmp_path / "users.dat", "1::F::1::10::48067\n2::M::56::16::70072\n")
    data = read_ml_1m(str(tmp_path))
    assert data.items.tolist() == [1193, 661, 1193]
    assert data.item_side.dense_columns["item_genres"] == ["Animation", "Children's", "Drama", "Musical"]
    assert data.item_side.dense["item_genres"].tolist() == [[0, 0, 1, 0], [1, 1, 0, 1]]
    assert data.user_side.categorical["user_gender"].tolist() == ["F", "M"]
    assert data.user_side.categorical["user_age"].tolist() == [1, 56]


def test_ml_20m_header_and_half_star_ratings(tmp_path):
    write(tmp_path / "ratings.csv", "userId,movieId,rating,timestamp\n1,2,3.5,1112486027\n1,29,4.0,1112484676\n")
    write(
        tmp_path / "movies.csv",
        'movieId,title,genres\n2,"Jumanji, The (1995)",Adventure|Children\n29,City (1995),(no genres listed)\n',
    )
    data = read_ml_20m(str(tmp_path))
    assert data.ratings.tolist() == [3.5, 4.0]
    assert data.item_side.keys.tolist() == [2, 29]
    assert data.item_side.dense["item_genres"].sum(1).tolist() == [2.0, 1.0]
    assert data.user_side is None


def test_ml_20m_wrong_header_names_line_one(tmp_path):
    write(tmp_path / "ratings.csv", "user,movie,rating,timestamp\n1,2,3.5,1112486027\n")
    with pytest.raises(DataFormatError, match=r"ratings\.csv:1: expected the header"):
        read_ml_20m(str(tmp_path))


def test_amazon_string_ids_keep_leading_zeros(tmp_path):
    path = write(tmp_path / "ratings_Books.csv", "A1B2C3,0123456789,5.0,1369267200\nA9,0000000001,1.0,1369267300\n")
    data = read_amazon(str(path))
    assert data.users.tolist() == ["A1B2C3", "A9"]
    assert data.items.tolist() == ["0123456789", "0000000001"]
    assert data.ratings.tolist() == [5.0, 1.0]


def test_generic_csv_picks_named_columns_and_side_features(tmp_path):
    path = write(
        tmp_path / "events.csv",
        "ts,who,what,score,country,brand\n100,7,42,1.0,FR,acme\n90,7,43,0.0,DE,zeta\n95,8,42,1.0,IT,acme\n",
    )
    columns = ColumnConfig(
        user="who", item="what", timestamp="ts", rating="score", user_features=("country",), item_features=("brand",)
    )
    data = read_table_csv(str(path), columns)
    assert data.users.dtype.kind == "i" and data.users.tolist() == [7, 7, 8]
    assert data.timestamps.tolist() == [100, 90, 95]
    assert data.user_side.keys.tolist() == [7, 8]
    assert data.user_side.categorical["country"].tolist() == ["DE", "IT"]  # a user's last row wins


def test_parquet_with_a_timestamp_column(tmp_path):
    table = pa.table({"u": ["x", "y", "x"], "i": [3, 4, 5], "t": pa.array([1_000, 2_000, 3_000], pa.timestamp("ms"))})
    pq.write_table(table, tmp_path / "events.parquet")
    data = read_table_parquet(str(tmp_path / "events.parquet"), ColumnConfig(user="u", item="i", timestamp="t"))
    assert data.users.tolist() == ["x", "y", "x"]
    assert data.timestamps.tolist() == [1, 2, 3]
    assert data.ratings is None


def test_parquet_null_and_missing_column_are_named(tmp_path):
    pq.write_table(pa.table({"u": [1, None], "i": [3, 4], "t": [5, 6]}), tmp_path / "a.parquet")
    with pytest.raises(DataFormatError, match=r"a\.parquet: row 2: column 'u' is null"):
        read_table_parquet(str(tmp_path / "a.parquet"), ColumnConfig(user="u", item="i", timestamp="t"))
    with pytest.raises(DataFormatError, match=r"a\.parquet: lacks column\(s\) \['when'\]"):
        read_table_parquet(str(tmp_path / "a.parquet"), ColumnConfig(user="u", item="i", timestamp="when"))


@pytest.mark.parametrize(
    "text, line, message",
    [
        ("1\t2\t3\t4\n1\t2\t3\n", 2, "expected 4 fields"),
        ("1\t2\t3\t4\n\n5\tabc\t3\t4\n", 3, "column 'item': expected an integer that fits int64, got 'abc'"),
        ("1\t2\t3\t4\n1\t2\tgood\t4\n", 2, "column 'rating': expected a number"),
        ("1\t2\t3\t4\n1\t2\t3\t\n", 2, "column 'timestamp': expected an integer that fits int64, got ''"),
        (
            "1\t2\t3\t4\n1\t2\t3\t9223372036854775808\n",
            2,
            "column 'timestamp': expected an integer that fits int64, got '9223372036854775808'",
        ),
        ("1\t2\t3\t4\n1\t2\tnan\t5\n", 2, "column 'rating': expected a number, got 'nan'"),
    ],
)
def test_bad_line_is_named_with_file_and_line(tmp_path, text, line, message):
    write(tmp_path / "u.data", text)
    with pytest.raises(DataFormatError, match=rf"u\.data:{line}: {message}"):
        read_ml_100k(str(tmp_path))


def test_malformed_line_in_a_double_colon_file_names_the_line(tmp_path):
    write(tmp_path / "ratings.dat", "1::1193::5::978300760\n1::661::3\n")
    with pytest.raises(DataFormatError, match=r"ratings\.dat:2: expected 4 fields separated by ::"):
        read_ml_1m(str(tmp_path))


def test_bad_side_file_line_is_named(tmp_path):
    ml_100k_dir(tmp_path)
    write(tmp_path / "u.user", "1|24|M|technician|85711\nx|60|F|other|94043\n")
    with pytest.raises(DataFormatError, match=r"u\.user:2: column 'user': expected an integer that fits int64, got"):
        read_ml_100k(str(tmp_path))


def test_missing_and_empty_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"u\.data: missing file"):
        read_ml_100k(str(tmp_path))
    write(tmp_path / "u.data", "\n")
    with pytest.raises(DataFormatError, match=r"u\.data: empty file"):
        read_ml_100k(str(tmp_path))
    write(tmp_path / "events.csv", "user_id,item_id,timestamp\n")
    with pytest.raises(DataFormatError, match=r"events\.csv: no data rows"):
        read_table_csv(str(tmp_path / "events.csv"), ColumnConfig())


def test_csv_missing_column_names_the_header_line(tmp_path):
    write(tmp_path / "events.csv", "user_id,item\n1,2\n")
    with pytest.raises(
        DataFormatError, match=r"events\.csv:1: the header lacks column\(s\) \['item_id', 'timestamp'\]"
    ):
        read_table_csv(str(tmp_path / "events.csv"), ColumnConfig())


def test_registry_dispatches_on_source(tmp_path):
    data = read_source(DataConfig(source="ml-100k", path=str(ml_100k_dir(tmp_path)), user_features=False))
    assert len(data.users) == 3 and data.user_side is None and data.item_side is not None


@pytest.mark.parametrize("keep", [False, True])
def test_rows_repeating_user_item_and_timestamp_are_dropped_and_counted_unless_kept(tmp_path, keep, caplog):
    root = ml_100k_dir(tmp_path)
    ratings = (root / "u.data").read_text()
    # every row again, plus (user 1, item 10) at another time: a repeat view, not a duplicate
    write(root / "u.data", ratings + ratings + "1\t10\t3\t881250999\n")
    data = read_source(DataConfig(source="ml-100k", path=str(root), keep_duplicates=keep))
    assert data.duplicates == 3 and data.duplicates_dropped is not keep
    rows = list(zip(data.users.tolist(), data.items.tolist(), data.timestamps.tolist(), data.ratings.tolist()))
    first = [(1, 10, 881250949, 4.0), (2, 10, 881250950, 2.0), (1, 30, 881250000, 5.0)]
    assert rows == (first + first if keep else first) + [(1, 10, 881250999, 3.0)]
    assert ("dropped 3 duplicate interactions" in caplog.text) is not keep


def test_generic_csv_bad_value_names_its_line(tmp_path):
    write(tmp_path / "events.csv", "user_id,item_id,timestamp\n1,2,100\n1,3,yesterday\n")
    with pytest.raises(DataFormatError, match=r"events\.csv:3: column 'timestamp': expected seconds .*'yesterday'$"):
        read_table_csv(str(tmp_path / "events.csv"), ColumnConfig())


ISO_TIMES = {  # text -> its seconds: UTC unless it has an offset, fractions floored
    "2024-01-05T10:00:00Z": 1704448800,
    "2024-01-05 12:00:00+02:00": 1704448800,
    "2024-01-05T10:00:00.999": 1704448800,
    "2024-01-05T05:30-04:30": 1704448800,
    "2024-01-05": 1704412800,
    "1969-12-31T23:59:59.5Z": -1,
}


def test_iso_8601_csv_timestamps_are_read_as_seconds_floored_utc_unless_offset(tmp_path):
    rows = "".join(f"u1,{i},{text}\n" for i, text in enumerate(ISO_TIMES))
    data = read_table_csv(str(write(tmp_path / "e.csv", "user_id,item_id,timestamp\n" + rows)), ColumnConfig())
    assert data.timestamps.dtype == np.int64 and data.timestamps.tolist() == list(ISO_TIMES.values())


@pytest.mark.parametrize(
    "text", ["2024-02-30", "2024-01-05T24:00:00", "2024-01-05T10:00:00+24:00", "2024-1-5", "05/01/2024"]
)
def test_a_bad_timestamp_text_names_the_file_line_and_column(tmp_path, text):
    write(tmp_path / "events.csv", f"user_id,item_id,timestamp\n1,2,100\n1,3,{text}\n")
    expected = f"expected seconds .* or an ISO 8601 date or time, got '{re.escape(text)}'$"
    message = rf"^{tmp_path / 'events.csv'}:3: column 'timestamp': {expected}"
    with pytest.raises(DataFormatError, match=message):
        read_table_csv(str(tmp_path / "events.csv"), ColumnConfig())


NANOSECOND_EPOCHS = [1700000000000000001, 1700000000000000002, 1700000000000000003, 1700000000000000100]


def test_csv_timestamps_and_ids_are_exact_integers(tmp_path):
    rows = "".join(f"u1,9007199254740993,{t}\n" for t in NANOSECOND_EPOCHS)  # 2^53 + 1: not a float64
    data = read_source(
        DataConfig(source="csv", path=str(write(tmp_path / "e.csv", "user_id,item_id,timestamp\n" + rows)))
    )
    assert data.timestamps.dtype == np.int64 and data.timestamps.tolist() == NANOSECOND_EPOCHS
    assert data.duplicates == 0 and data.items.tolist() == [9007199254740993] * 4


def test_parquet_timestamps_and_ids_are_exact_integers(tmp_path):
    table = pa.table({"user_id": ["u1"] * 4, "item_id": pa.array([2**63 - 1] * 4), "timestamp": NANOSECOND_EPOCHS})
    pq.write_table(table, tmp_path / "e.parquet")
    data = read_source(DataConfig(source="parquet", path=str(tmp_path / "e.parquet")))
    assert data.timestamps.tolist() == NANOSECOND_EPOCHS and data.duplicates == 0
    assert data.items.tolist() == [2**63 - 1] * 4


def test_decimal_csv_timestamps_are_floored_exactly(tmp_path):
    write(tmp_path / "e.csv", "user_id,item_id,timestamp\n1,2,100.9\n1,3,-1.5\n1,4,1.7e9\n1,5,1700000000000000001.5\n")
    data = read_table_csv(str(tmp_path / "e.csv"), ColumnConfig())
    assert data.timestamps.tolist() == [100, -2, 1_700_000_000, 1700000000000000001]


@pytest.mark.parametrize(
    "row, message",
    [
        ("1,2,1e23", "column 'timestamp': expected seconds .*, got '1e23'"),
        ("1,2,1.5e30", "column 'timestamp': expected seconds .*, got '1.5e30'"),
        ("1,2,-9223372036854775809", "column 'timestamp': expected seconds .*, got '-9223372036854775809'"),
        ("1,2,1e9999999999999999999", "column 'timestamp': expected seconds .*, got '1e9999999999999999999'"),
        ("1,2,5e-9999999999999999999", "column 'timestamp': expected seconds .*, got '5e-9999999999999999999'"),
        ("18446744073709551615,2,5", "column 'user_id': id 18446744073709551615 does not fit int64"),
    ],
)
def test_csv_values_past_int64_are_errors_naming_file_line_and_column(tmp_path, row, message):
    write(tmp_path / "e.csv", f"user_id,item_id,timestamp\n1,2,3\n{row}\n")
    with pytest.raises(DataFormatError, match=rf"e\.csv:3: {message}"):
        read_table_csv(str(tmp_path / "e.csv"), ColumnConfig())
    write(tmp_path / "e.csv", f'user_id,item_id,timestamp\n1,"two\nlines",3\n{row}\n')  # a record over 2 lines
    with pytest.raises(DataFormatError, match=rf"e\.csv:4: {message}"):
        read_table_csv(str(tmp_path / "e.csv"), ColumnConfig())


@pytest.mark.parametrize(
    "column, values, message",
    [
        ("timestamp", pa.array([1, 2**64 - 1], pa.uint64()), "row 2: column 'timestamp': 18446744073709551615 does"),
        ("timestamp", pa.array([1.0, 1e23]), r"row 2: column 'timestamp': 1e\+23 is not seconds within int64"),
        ("user_id", pa.array([1, 2**64 - 1], pa.uint64()), "row 2: column 'user_id': id 18446744073709551615 does"),
    ],
)
def test_parquet_values_past_int64_are_errors_naming_row_and_column(tmp_path, column, values, message):
    table = {"user_id": pa.array([1, 1]), "item_id": ["a", "b"], "timestamp": pa.array([1, 2]), column: values}
    pq.write_table(pa.table(table), tmp_path / "e.parquet")
    with pytest.raises(DataFormatError, match=rf"e\.parquet: {message}"):
        read_table_parquet(str(tmp_path / "e.parquet"), ColumnConfig())


def test_na_like_ids_and_categories_are_plain_strings_and_an_empty_one_is_named(tmp_path):
    text = "user_id,item_id,timestamp,brand\nNA,null,1,N/A\nnan,NaN,2,None\n#N/A,<NA>,3,NULL\n"
    columns = ColumnConfig(item_features=("brand",))
    data = read_table_csv(str(write(tmp_path / "e.csv", text)), columns)
    assert data.users.tolist() == ["NA", "nan", "#N/A"] and data.items.tolist() == ["null", "NaN", "<NA>"]
    assert data.item_side.categorical["brand"].tolist() == ["NULL", "None", "N/A"]  # keyed by sorted item id
    write(tmp_path / "e.csv", text + '4,"",5,x\n')
    with pytest.raises(DataFormatError, match=r"e\.csv:5: column 'item_id': expected a non-empty value, got ''"):
        read_table_csv(str(tmp_path / "e.csv"), columns)
