"""``gr export RUN_DIR EXPORT_DIR [--overwrite] [--hstu-dtype bfloat16]`` writes an export;
``gr check EXPORT_DIR`` validates one (exit status 1 when it has problems) and warns
of temporary directories that killed exports left beside it (``gr.utils.atomic.stale_directories``).
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
        parser = argparse.ArgumentParser(prog="gr check", description="Validate an export directory.")
        parser.add_argument("export_dir", type=Path)
        args = parser.parse_args(argv[1:])
        if not args.export_dir.is_dir():
            raise NotADirectoryError(f"{args.export_dir}: no such export directory")
        from gr.export.reader import check_export  # the export reader (torch, onnx): once the arguments parse

        problems = check_export(args.export_dir)
        for problem in problems:
            print(f"ERROR {problem}")
        for stale in stale_directories(args.export_dir):
            print(
                f"WARNING {stale}: a temporary directory left by an interrupted export (no live process "
                f"holds it); the next export to {args.export_dir} removes it"
            )
        print(f"{args.export_dir}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
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
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        raise NotADirectoryError(f"{args.run_dir}: no such run directory")
    from gr.export.writer import export_run  # onnx and the training code, loaded only to export (seconds)

    start = time.perf_counter()
    try:
        export_run(args.run_dir, args.export_dir, overwrite=args.overwrite, hstu_dtype=args.hstu_dtype)
    except ExportError as exc:  # the run does not export (a RuntimeError, not bad input)
        print(f"gr export: error: {exc}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in args.export_dir.rglob("*") if p.is_file())
    elapsed = time.perf_counter() - start
    print(f"exported {args.run_dir} -> {args.export_dir} in {elapsed:.1f}s ({size / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
