"""The supervisor of ``gr serve --workers N``: uvicorn's, which starts a new worker process in the
place of one that ended (killed, crashed, or exited as a worker whose batcher stopped does), and
here also says so: one warning on ``gr.serve`` naming the worker that ended, its exit status or
the signal that ended it, and the worker started in its place."""

from __future__ import annotations

import logging
import signal
from typing import Optional

from uvicorn.supervisors import Multiprocess

log = logging.getLogger("gr.serve")


class LoggedMultiprocess(Multiprocess):
    """uvicorn's ``Multiprocess``, logging each worker it replaces."""

    def keep_subprocess_alive(self) -> None:
        before = list(self.processes)
        super().keep_subprocess_alive()
        for old, new in zip(before, self.processes):
            if new is not old:
                log.warning("worker %s %s; started worker %s in its place", old.pid, ended(old.exitcode), new.pid)


def ended(exitcode: Optional[int]) -> str:
    """How a process ended, from its ``multiprocessing`` exit code (-N: killed by signal N)."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"
