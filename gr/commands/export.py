"""``gr export RUN_DIR EXPORT_DIR [--overwrite] [--hstu-dtype bfloat16] [--base PREV_EXPORT]`` writes
an export (with ``--base``: the delta from an earlier export of the model); ``gr export --squash
EXPORT DELTA... OUT`` writes the full export a chain makes; ``gr check EXPORT_DIR [DELTA...]``
validates an export, a delta or a chain (exit status 1 when it has problems) and warns of temporary
directories that killed exports left beside it (``gr.utils.atomic.stale_directories``).
``python -m gr.export [check] ...`` runs the same."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional

from gr.export.format import ExportError
from gr.utils.atomic import stale_directories
from gr.utils.cli_errors import run_cli


def main(argv: Optional[List[str]] = None) -> int:
    """Bad input (a missing run or export directory, an unreadable file) ends in one line on
    stderr, prefixed by the command (``gr export:`` or ``gr check:``), and exit status 2
    (``gr.utils.cli_errors``)."""
    args = sys.argv[1:] if argv is None else argv
    return run_cli("gr check" if args[:1] == ["check"] else "gr export", lambda: _main(args))


def _main(argv: List[str]) -> int:
    if argv and argv[0] == "check":
        parser = argparse.ArgumentParser(
            prog="gr check",
            description="Validate an export directory, a delta, or a chain: a full export, then its deltas in order.",
        )
        parser.add_argument("export_dir", type=Path, nargs="+")
        args = parser.parse_args(argv[1:])
        for path in args.export_dir:
            if not path.is_dir():
                raise NotADirectoryError(f"{path}: no such export directory")
        # the export reader (torch, onnx): once the arguments parse
        from gr.export.delta import check_chain, is_delta, read_delta
        from gr.export.reader import check_export

        paths = args.export_dir
        if len(paths) > 1:
            problems = check_chain(paths)
        elif is_delta(paths[0]):
            problems = []
            read_delta(paths[0], problems)
        else:
            problems = check_export(paths[0])
        for problem in problems:
            print(f"ERROR {problem}")
        for path in paths:
            for stale in stale_directories(path):
                print(
                    f"WARNING {stale}: a temporary directory left by an interrupted export (no live process "
                    f"holds it); the next export to {path} removes it"
                )
        label = " ".join(map(str, paths))
        print(f"{label}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    if "--squash" in argv:
        return _squash(argv)
    parser = argparse.ArgumentParser(
        prog="gr export",
        description="Export a training run's best checkpoint as serving slices (gr check EXPORT_DIR validates one).",
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("export_dir", type=Path)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing export directory")
    parser.add_argument(
        "--hstu-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="how hstu/model.safetensors stores the weights (serving computes in float32)",
    )
    parser.add_argument(
        "--base",
        type=Path,
        help="an earlier full export of this run, or of a run it was warm-started from: write only what "
        "changed since it (a delta; gr export --squash makes the full export again)",
    )
    parser.add_argument(
        "--squash",
        action="store_true",
        help="gr export --squash EXPORT DELTA... OUT: write the full export a chain (a full export, "
        "then its deltas in order) makes",
    )
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        raise NotADirectoryError(f"{args.run_dir}: no such run directory")
    if args.base is not None and not args.base.is_dir():
        raise NotADirectoryError(f"--base {args.base}: no such export directory")
    from gr.export.writer import export_run  # onnx and the training code, loaded only to export (seconds)

    start = time.perf_counter()
    try:
        export_run(args.run_dir, args.export_dir, overwrite=args.overwrite, hstu_dtype=args.hstu_dtype, base=args.base)
    except ExportError as exc:  # the run does not export (a RuntimeError, not bad input)
        print(f"gr export: error: {exc}", file=sys.stderr)
        return 1
    kind = "" if args.base is None else f" (delta from {args.base})"
    print(f"exported {args.run_dir} -> {args.export_dir}{kind} in {_took(start)} ({_mib(args.export_dir)})")
    return 0


def _squash(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="gr export --squash",
        description="Write the full export a chain makes: a full export, then its deltas in order, then OUT.",
    )
    parser.add_argument("--squash", action="store_true", required=True)
    parser.add_argument("chain", type=Path, nargs="+", metavar="EXPORT DELTA...")
    parser.add_argument("out", type=Path, metavar="OUT")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    args = parser.parse_args(argv)
    for path in args.chain:
        if not path.is_dir():
            raise NotADirectoryError(f"{path}: no such export directory")
    from gr.export.delta import squash  # the export reader (torch, onnx): once the arguments parse

    start = time.perf_counter()
    squash(args.chain, args.out, overwrite=args.overwrite)
    deltas = len(args.chain) - 1
    print(f"squashed {deltas} delta(s) onto {args.chain[0]} -> {args.out} in {_took(start)} ({_mib(args.out)})")
    return 0


def _took(start: float) -> str:
    return f"{time.perf_counter() - start:.1f}s"


def _mib(directory: Path) -> str:
    return f"{sum(p.stat().st_size for p in directory.rglob('*') if p.is_file()) / 2**20:.2f} MiB"


if __name__ == "__main__":
    sys.exit(main())
