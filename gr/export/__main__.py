"""``python -m gr.export RUN_DIR EXPORT_DIR [--overwrite]`` writes an export;
``python -m gr.export check EXPORT_DIR`` validates one (exit status 1 when it has problems)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "check":
        parser = argparse.ArgumentParser(prog="python -m gr.export check", description="Validate an export directory.")
        parser.add_argument("export_dir", type=Path)
        args = parser.parse_args(argv[1:])
        from gr.export.reader import check_export

        problems = check_export(args.export_dir)
        for problem in problems:
            print(f"ERROR {problem}")
        print(f"{args.export_dir}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
        return 1 if problems else 0
    parser = argparse.ArgumentParser(
        prog="python -m gr.export",
        description="Export a training run's best checkpoint as serving slices "
        "(or: python -m gr.export check EXPORT_DIR).",
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("export_dir", type=Path)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing export directory")
    args = parser.parse_args(argv)
    from gr.export.format import ExportError
    from gr.export.writer import export_run

    start = time.perf_counter()
    try:
        export_run(args.run_dir, args.export_dir, overwrite=args.overwrite)
    except (ExportError, FileExistsError, FileNotFoundError, ValueError) as exc:  # ExportFormatError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in args.export_dir.rglob("*") if p.is_file())
    elapsed = time.perf_counter() - start
    print(f"exported {args.run_dir} -> {args.export_dir} in {elapsed:.1f}s ({size / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
