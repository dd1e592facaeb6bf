"""A CSV training log that appends: a resumed run keeps the earlier epochs' rows.

Lightning's CSVLogger deletes an existing ``metrics.csv`` when it opens its writer; here
the writer keeps the file and starts from its header, so new rows go after the old ones
(and a column first seen after the resume rewrites the file with every row kept). A resume
first drops the rows logged after its checkpoint (``drop_rows_from_step``): the resume
trains those steps again, so the log holds each step once.
"""

from __future__ import annotations

import csv
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

from gr.utils.atomic import atomic_file


class AppendingExperimentWriter(ExperimentWriter):
    """ExperimentWriter that keeps an existing metrics.csv and its columns."""

    def _check_log_dir_exists(self) -> None:
        path = Path(self.metrics_file_path)
        if path.is_file():
            with open(path, newline="", encoding="utf8") as handle:
                self.metrics_keys = sorted(next(csv.reader(handle), []))


class AppendingCSVLogger(CSVLogger):
    """CSVLogger whose metrics.csv survives a resume."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = AppendingExperimentWriter(log_dir=self.log_dir)
        return self._experiment  # type: ignore[return-value]  # Lightning types it as its private base writer


def drop_rows_from_step(metrics_csv: Path, step: int) -> int:
    """Remove the rows of ``metrics_csv`` whose ``step`` is ``step`` or later; returns how many.

    step: the checkpoint's count of optimizer steps (Lightning's ``_batches_that_stepped``); the
    rows it covers were logged at steps below it. The file is rewritten atomically; a missing
    file is left missing."""
    if not metrics_csv.is_file():
        return 0
    with open(metrics_csv, newline="", encoding="utf8") as handle:
        reader = csv.DictReader(handle)
        columns, rows = reader.fieldnames or [], list(reader)
    kept = [row for row in rows if not row.get("step") or int(row["step"]) < step]
    if len(kept) < len(rows):
        with atomic_file(metrics_csv) as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(kept)
    return len(rows) - len(kept)
