"""The history timestamp policy (``gr.timestamps``): oldest first, ties and negative seconds allowed,
int64 only; each refusal names the field first."""

import numpy as np
import pytest

from gr.data.config import ColumnConfig
from gr.data.interactions import DataFormatError
from gr.data.readers import read_table_csv
from gr.data.sequences import build_sequences
from gr.timestamps import INT64_MAX, INT64_MIN, TimestampError, check_history_timestamps, check_time_span


@pytest.mark.parametrize("ts", [[], [5], [1, 1, 1], [-86400, -1, 0, 7], [2**63 - 1, 2**63 - 1]])
def test_ordered_histories_with_ties_and_negative_seconds_pass(ts):
    check_history_timestamps(np.asarray(ts, dtype=np.int64), "history.timestamps")


@pytest.mark.parametrize(
    "ts, message",
    [
        (np.array([10, 20, 15]), r"history\.timestamps: out of order: \[2\] = 15 is earlier than \[1\] = 20"),
        (np.array([0, 2**64 - 1], dtype=np.uint64), r"history\.timestamps: \[1\] = 18446744073709551615 does not fit"),
        (np.array([1.5, 2.0]), r"history\.timestamps: expected a list of integers"),
    ],
)
def test_out_of_order_wrapped_or_non_integer_timestamps_are_refused_naming_the_field(ts, message):
    with pytest.raises(TimestampError, match=message):
        check_history_timestamps(ts, "history.timestamps")


def test_times_of_one_request_up_to_2_63_minus_1_seconds_apart_pass():
    check_time_span({"history.timestamps": np.array([-(2**62), 0]), "request_time": 2**62 - 1, "other": None})
    check_time_span({"history.timestamps": np.array([INT64_MIN]), "candidates.timestamps": np.array([-1])})


@pytest.mark.parametrize(
    "times, message",
    [
        ({"history.timestamps": np.array([INT64_MIN, 0])}, r"history\.timestamps: 0 lies 9223372036854775808 s after"),
        (
            {"history.timestamps": np.array([-5, 0]), "candidates.timestamps": np.array([1, INT64_MAX - 4])},
            r"candidates\.timestamps: 9223372036854775803 lies .* after -5 \(history\.timestamps\)",
        ),
        ({"history.timestamps": np.array([-1]), "request_time": INT64_MAX}, r"^request_time: "),
    ],
)
def test_times_of_one_request_2_63_seconds_apart_are_refused_naming_the_field(times, message):
    with pytest.raises(TimestampError, match=message):
        check_time_span(times)


def test_a_user_whose_events_lie_2_63_seconds_apart_is_refused_naming_the_user(tmp_path):
    path = tmp_path / "events.csv"
    rows = ["u1,a,10", "u1,b,20", "u1,c,30", f"u2,a,{INT64_MIN}", "u2,b,0", "u2,c,5"]
    path.write_text("user_id,item_id,ts\n" + "\n".join(rows) + "\n")
    data = read_table_csv(str(path), ColumnConfig(user="user_id", item="item_id", timestamp="ts"))
    with pytest.raises(DataFormatError, match=r"user 'u2': timestamps from -9223372036854775808 to 5 lie 2\^63 s"):
        build_sequences(data, min_seq_len=3)
    path.write_text(path.read_text().replace(str(INT64_MIN), str(-(2**62))))  # 2^62 s apart: trains
    data = read_table_csv(str(path), ColumnConfig(user="user_id", item="item_id", timestamp="ts"))
    assert build_sequences(data, min_seq_len=3)[0].timestamps.min() == -(2**62)
