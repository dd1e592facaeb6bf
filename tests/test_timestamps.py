"""The history timestamp policy (``gr.timestamps``): oldest first, ties and negative seconds allowed,
int64 only; each refusal names the field first."""

import numpy as np
import pytest

from gr.timestamps import TimestampError, check_history_timestamps


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
