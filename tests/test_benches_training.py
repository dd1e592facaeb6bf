"""The training and data benchmarks (``TRAINING_BENCHES`` of tests/test_benches.py) at their ``--smoke``
size: each ends with its promised JSON line. A module of its own so that the suite's two workers
share the benchmarks' runs."""

import pytest
from test_benches import check_smoke_run, smoke_params


@pytest.mark.parametrize("bench", smoke_params(training=True))
def test_training_benchmark_smoke_run_ends_with_its_promised_json(bench, warm_python, tmp_path):
    check_smoke_run(bench, warm_python, tmp_path)
