"""The ``gr`` command: one entry point with git-style subcommands.

``gr train | export | check | serve | rank | recommend | generate | evaluate | predict | plan | data download |
data prepare``.
Each subcommand forwards its arguments to its module in ``gr.commands`` (``train``, ``export``,
``serve``, ``evaluate``, ``predict``, ``plan``, ``data``), imported only when chosen (by name, through
importlib: the only lazy loading of ``gr`` modules here), so ``gr --help`` and ``gr data download``
never import torch.

The working directory is importable (as under ``python -m gr``), so a recipe's
``model.class`` / ``prefix_dnn.class`` can name a module of the project it is run from
(``examples.custom_project.model.GenreModel`` from the repository root).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

from gr.utils.console import quiet_console
from gr.utils.devices import configure_backend_autoload, configure_onednn_cache


class Command(NamedTuple):
    """module:function to call with the remaining arguments, after ``prefix``."""

    module: str
    function: str
    summary: str
    prefix: tuple = ()


COMMANDS: Dict[str, Command] = {
    "train": Command("gr.commands.train", "main", "train a model from a recipe YAML (gr train --help lists every key)"),
    "export": Command("gr.commands.export", "main", "export a run's best checkpoint as serving slices"),
    "check": Command("gr.commands.export", "main", "validate an export directory", ("check",)),
    "serve": Command("gr.commands.serve", "main", "run the HTTP service over an export", ("serve",)),
    "rank": Command("gr.commands.serve", "main", "score a request file's candidates", ("rank",)),
    "recommend": Command(
        "gr.commands.serve", "main", "each request's top k catalogue items (retrieval exports)", ("recommend",)
    ),
    "generate": Command("gr.commands.serve", "main", "generate each request's next items", ("generate",)),
    "evaluate": Command("gr.commands.evaluate", "main", "test-split metrics of a run or an export (serving path)"),
    "predict": Command(
        "gr.commands.predict", "main", "score a Parquet file of users (candidates or top-k) with an export"
    ),
    "plan": Command("gr.commands.plan", "main", "parameter counts and memory per rank for a recipe"),
    "data": Command(
        "gr.commands.data",
        "main",
        "gr data download NAME DIR: fetch a public dataset; gr data prepare --config C --out DIR: prepare it",
    ),
    "items": Command("gr.commands.items", "main", "gr items add EXPORT ITEMS --out NEW: new items, no retraining"),
}
# Commands that take a subcommand: {command: ({subcommand: its function in the command's module}, an example)}.
SUBCOMMANDS = {
    "data": ({"download": "main", "prepare": "prepare"}, "gr data download ml-1m DIR"),
    "items": ({"add": "main"}, "gr items add exports/e new_items.csv --out exports/e2"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: gr COMMAND [ARGS...]   (gr COMMAND --help for a command's options)", "", "commands:"]
    lines += [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    return "\n".join(lines)


def resolve(argv: Sequence[str]) -> tuple[Optional[Callable[[List[str]], int]], List[str], str]:
    """-> (the subcommand's main or None for usage, its arguments, error text or "")."""
    if not argv or argv[0] in ("-h", "--help"):
        return None, [], ""
    name, rest = argv[0], list(argv[1:])
    if name not in COMMANDS:
        return None, [], f"gr: unknown command {name!r}; expected one of {sorted(COMMANDS)}"
    command = COMMANDS[name]
    function_name = command.function
    if name in SUBCOMMANDS:
        subcommands, example = SUBCOMMANDS[name]
        if not rest or rest[0] not in subcommands:
            return None, [], f"gr {name}: expected a subcommand {list(subcommands)}, e.g. {example}"
        function_name = subcommands[rest[0]]
        rest = rest[1:]
    function = getattr(importlib.import_module(command.module), function_name)
    return function, [*command.prefix, *rest], ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    configure_backend_autoload()  # before torch is imported: torch_npu autoloads only on an NPU host
    configure_onednn_cache()
    quiet_console()  # before fbgemm_gpu is imported: its logging.basicConfig() then adds no handler
    if "" not in sys.path and os.getcwd() not in sys.path:  # the console script's path starts at its bin/
        sys.path.insert(0, os.getcwd())
    argv = sys.argv[1:] if argv is None else list(argv)
    function, rest, error = resolve(argv)
    if function is None:
        print(error or usage(), file=sys.stderr if error else sys.stdout)
        return 2 if error else 0
    return int(function(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
