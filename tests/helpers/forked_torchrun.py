"""``torchrun --nproc_per_node N SCRIPT ARGS...`` with ranks forked from this process, not started afresh.

``python tests/helpers/forked_torchrun.py N SCRIPT ARGS...``, run by a warm interpreter
(``helpers.warm``): torch's elastic launcher, what torchrun runs, starts N ranks with
``start_method="fork"``; each runs SCRIPT as ``python SCRIPT ARGS...`` would, with torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) and this process's
stdout and stderr. The ranks inherit the warm interpreter's imports (torch, Lightning, gr): a
launch costs no interpreter start-up. Exits non-zero, with the launcher's report, if a rank fails.
"""

import os
import runpy
import sys
import uuid
from typing import List

from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def run_rank(script: str, args: List[str]) -> None:
    """In a rank: ``python SCRIPT ARGS...``; a non-zero exit status is this rank's failure."""
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise RuntimeError(f"{script} exited with status {stop.code}") from None


if __name__ == "__main__":
    nproc, script, *script_args = sys.argv[1:]
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=int(nproc),
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        start_method="fork",
    )
    elastic_launch(launch, run_rank)(script, script_args)
