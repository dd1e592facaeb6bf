"""Readable console output at our entry points (``gr ...``, ``train.py``): each log line once,
known third-party noise filtered by its exact message, never by silencing logging or warnings.

* fbgemm_gpu calls ``logging.basicConfig`` on import, giving the root logger a handler;
  Lightning's ``lightning`` logger prints with its own handler and propagates, so each
  Lightning line was printed twice. A root handler installed here first turns that
  ``basicConfig`` into a no-op (and replaces one already installed); it prints every record
  except Lightning's, which Lightning prints itself.
* The messages in ``KNOWN_WARNINGS`` / ``KNOWN_LOG_LINES`` say nothing a user can act on.
* gr's own info lines (what was read, a warm start's origin) are printed: the ``gr`` logger is
  set to INFO unless a level was set for it. Under torchrun every rank runs the same code on the
  same data: gr's own info and warnings (e.g. duplicate rows dropped) are printed by rank 0 only;
  errors by every rank.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from typing import Any, Dict, Tuple, Type

FORMAT = "%(levelname)s %(name)s: %(message)s"
# (category, regex matched at the start of the message)
KNOWN_WARNINGS: Tuple[Tuple[Type[Warning], str], ...] = (
    # TorchRec's planner about its default storage reservation (we do not plan in dry run).
    (FutureWarning, r"HeuristicalStorageReservation is known to cause issues"),
    # DCP about the ShardedTensors in TorchRec's sharded state dicts (TorchRec's choice, not ours).
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
    # torch 2.13 deprecates pytree's LeafSpec, which Lightning 2.6 and torch.export still build.
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # GRTrainingModule.transfer_batch_to_device is meant to be used (ids go where the tables are):
    # Lightning only says it picks the module's hook over the data module's default one.
    (UserWarning, r"You have overridden `transfer_batch_to_device` in `LightningModule` but have passed in a"),
    # A prepared dataset's batches (gr.data.prepared.stream) count exactly what every DataLoader worker yields.
    (UserWarning, r"Your `IterableDataset` has `__len__` defined\. In combination with multi-process data loading"),
    # Lightning counts trainer.log_every_n_steps over the run's steps, not each epoch's: an epoch of fewer
    # batches (a warm start's new day) is still logged every N steps.
    (UserWarning, r"The number of training batches \(\d+\) is smaller than the logging interval"),
    # `gr train` refuses an --out that holds checkpoints, so this fires on --resume only, where it must exist.
    (UserWarning, r"Checkpoint directory .* exists and is not empty\.$"),
    # ONNX export names a dynamic axis once: the token features of a PrefixDNN reading several (and the
    # common features of a PostfixDNN) share the tokens (targets) axis, and the exporter keeps its first name.
    (UserWarning, r"# The axis name: \w+ will not be used, since it shares the same shape constraints"),
)
# logger name -> regex searched in the formatted message
KNOWN_LOG_LINES: Dict[str, str] = {
    "torchrec.distributed.planner.storage_reservations": r"^There is a known issue with TorchRec's dense tensor size",
    # ONNX export registers torchvision's ops when it can; we export no torchvision op.
    "torch.onnx._internal.exporter._registration": r"^torchvision is not installed",
    # TorchRec asks torch.fx whether it is tracing; torch logs that the answer also covers torch.export.
    "torch.fx._symbolic_trace": r"^is_fx_tracing will return true for both fx.symbolic_trace and torch.export",
    # A one-process run's process group (gloo, world size 1); multi-process runs keep these lines.
    "lightning.fabric.utilities.distributed": r"^Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/1$",
    "lightning.pytorch.utilities.rank_zero": (
        r"distributed_backend=\w+\nAll distributed processes registered\. "
        r"Starting with 1 processes\n|^💡 Tip: For seamless cloud logging"
    ),
}
LIGHTNING = "lightning"
GR = "gr"
RANK_ENV = ("RANK", "LOCAL_RANK")


class MessageFilter(logging.Filter):
    """Drops the records whose formatted message matches ``pattern``."""

    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.search(record.getMessage()) is None


class _RankZeroOnly(logging.Filter):
    """gr's own records below ERROR, dropped on the ranks other than 0 of a multi-process run:
    every rank reads the same data and config, so rank 0 says what they would all say."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not (record.name == GR or record.name.startswith(GR + "."))


def _process_rank() -> int:
    """This process's rank as torchrun (``RANK``) or a Lightning launcher (``LOCAL_RANK``) set it; 0 alone."""
    for name in RANK_ENV:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


class _NotLightning(logging.Filter):
    """Lightning's records: its own handler on the ``lightning`` logger prints them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != LIGHTNING and not record.name.startswith(LIGHTNING + ".")


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is at each record, not as it was when installed (a caller
    that redirects stderr, as pytest's capture does, still gets the lines)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # StreamHandler.__init__ sets it


def quiet_console() -> None:
    """Install the root handler and the message filters above (idempotent)."""
    for category, pattern in KNOWN_WARNINGS:  # re-adding a filter moves it to the front, never duplicates it
        warnings.filterwarnings("ignore", message=pattern, category=category)
    ours = logging.getLogger(GR)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "_gr_console", False):
            return
        if handler.formatter is not None and handler.formatter._fmt == logging.BASIC_FORMAT:
            root.removeHandler(handler)  # a basicConfig() handler (fbgemm_gpu's)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_NotLightning())
    if _process_rank() != 0:
        handler.addFilter(_RankZeroOnly())
    handler._gr_console = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    for name, pattern in KNOWN_LOG_LINES.items():
        logging.getLogger(name).addFilter(MessageFilter(pattern))
