"""Run several trainings in one torchrun launch (one process start-up and import for all of them).

``python -m torch.distributed.run --nproc_per_node N tests/helpers/torchrun_runs.py RUNS.json`` where
RUNS.json is a list of ``{"config": {...TrainConfig values...}, "out": dir, "resume": bool}``,
run in order, each as ``gr.train.train`` (what ``train.py`` runs).
"""

import json
import os
import sys

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from gr.commands.train import end_process_group  # noqa: E402
from gr.train import train  # noqa: E402
from gr.train.config import TrainConfig  # noqa: E402

if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        runs = json.load(handle)
    for run in runs:
        train(TrainConfig.from_dict(run["config"]), run["out"], resume=run.get("resume", False))
    end_process_group()
