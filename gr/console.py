"""Readable console output at our entry points (``gr ...``, ``train.py``): each log line once,
known third-party noise filtered by its exact message, never by silencing logging or warnings.

* fbgemm_gpu calls ``logging.basicConfig`` on import, giving the root logger a handler;
  Lightning's ``lightning`` logger prints with its own handler and propagates, so each
  Lightning line was printed twice. A root handler installed here first turns that
  ``basicConfig`` into a no-op (and replaces one already installed); it prints every record
  except Lightning's, which Lightning prints itself.
* The messages in ``KNOWN_WARNINGS`` / ``KNOWN_LOG_LINES`` say nothing a user can act on.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from typing import Dict, Tuple, Type

FORMAT = "%(levelname)s %(name)s: %(message)s"
# (category, regex matched at the start of the message)
KNOWN_WARNINGS: Tuple[Tuple[Type[Warning], str], ...] = (
    # TorchRec's planner about its default storage reservation (we do not plan in dry run).
    (FutureWarning, r"HeuristicalStorageReservation is known to cause issues"),
)
# logger name -> regex searched in the formatted message
KNOWN_LOG_LINES: Dict[str, str] = {
    "torchrec.distributed.planner.storage_reservations": r"^There is a known issue with TorchRec's dense tensor size",
    # ONNX export registers torchvision's ops when it can; we export no torchvision op.
    "torch.onnx._internal.exporter._registration": r"^torchvision is not installed",
    # A one-process run's process group (gloo, world size 1); multi-process runs keep these lines.
    "lightning.fabric.utilities.distributed": r"^Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/1$",
    "lightning.pytorch.utilities.rank_zero": (
        r"distributed_backend=\w+\nAll distributed processes registered\. "
        r"Starting with 1 processes\n|^💡 Tip: For seamless cloud logging"
    ),
}
LIGHTNING = "lightning"


class MessageFilter(logging.Filter):
    """Drops the records whose formatted message matches ``pattern``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.search(record.getMessage()) is None


class _NotLightning(logging.Filter):
    """Lightning's records: its own handler on the ``lightning`` logger prints them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != LIGHTNING and not record.name.startswith(LIGHTNING + ".")


def quiet_console() -> None:
    """Install the root handler and the message filters above (idempotent)."""
    for category, pattern in KNOWN_WARNINGS:  # re-adding a filter moves it to the front, never duplicates it
        warnings.filterwarnings("ignore", message=pattern, category=category)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "_gr_console", False):
            return
        if handler.formatter is not None and handler.formatter._fmt == logging.BASIC_FORMAT:
            root.removeHandler(handler)  # a basicConfig() handler (fbgemm_gpu's)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_NotLightning())
    handler._gr_console = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    for name, pattern in KNOWN_LOG_LINES.items():
        logging.getLogger(name).addFilter(MessageFilter(pattern))
