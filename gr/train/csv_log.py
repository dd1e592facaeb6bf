"""A CSV training log that appends: a resumed run keeps the earlier epochs' rows.

Lightning's CSVLogger deletes an existing ``metrics.csv`` when it opens its writer; here
the writer keeps the file and starts from its header, so new rows go after the old ones
(and a column first seen after the resume rewrites the file with every row kept).
"""

from __future__ import annotations

import csv
from pathlib import Path

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


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
        return self._experiment
