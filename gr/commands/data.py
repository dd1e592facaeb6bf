"""``gr data download NAME DIR``: fetch a public dataset (``gr.data.download``) and print what it holds.
``gr data prepare --config C --out DIR``: write the prepared sequence dataset of a config's data section
(``gr.data.prepared``) with an engine (DuckDB, or Spark); ``--append PARTITION --out DIR`` adds a
partition of later events to it (``gr.data.prepared.duckdb_append``).

Imports no torch (``gr.data.download`` reads with numpy, a config's data section is read without
torch), like ``gr --help``; ``gr data prepare`` imports its engine once its arguments are parsed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from gr.commands.train import parse_overrides
from gr.data.config import DataConfig
from gr.data.download import DATASETS, DownloadError, download_dataset
from gr.train.config import apply_override, parse_value, read_recipe
from gr.utils.cli_errors import USAGE_EXIT_STATUS, one_line, run_cli
from gr.utils.outputs import checked_output

# --engine NAME -> (module, function): prepare(config, out, **options) -> PreparedManifest (``_engine_options``)
ENGINES = {
    "duckdb": ("gr.data.prepared.duckdb_engine", "prepare_with_duckdb"),
    "spark": ("gr.data.prepared.spark_engine", "prepare_with_spark"),
}


def describe() -> str:
    """The --help epilog: each dataset's URL, checks and licence terms."""
    lines = ["datasets (use each under its licence terms):"]
    for name, source in DATASETS.items():
        digest = (
            "md5 published by the host"
            if source.md5
            else "sha256 published"
            if source.sha256
            else "no published checksum: --sha256 required"
        )
        items = f", {source.items:,} items" if source.items is not None else ""
        lines += [
            f"  {name}: {source.url}",
            f"    {digest}; checks {source.interactions:,} interactions{items}",
            f"    terms: {source.terms}",
        ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gr data download",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Download a public dataset, verify its checksum, unpack it into DIR and check its counts.",
        epilog=describe(),
    )
    parser.add_argument("name", choices=sorted(DATASETS), metavar="NAME", help=f"one of {sorted(DATASETS)}")
    parser.add_argument("dir", type=Path, metavar="DIR", help="directory to create with the dataset's files")
    parser.add_argument("--sha256", help="expected SHA-256 (hex) of the download; required for amazon-books")
    parser.add_argument("--url", help="a mirror of the same file (the same checksums apply)")
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        record = download_dataset(
            args.name,
            checked_output(args.dir, (), "DIR"),
            sha256=args.sha256,
            url=args.url,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
    except (DownloadError, OSError, ValueError) as error:  # OSError: DIR exists or cannot be written
        print(f"gr data download: error: {type(error).__name__}: {one_line(error)}", file=sys.stderr)
        return USAGE_EXIT_STATUS
    print(
        f"{args.name}: {record['interactions']:,} interactions, {record['items']:,} items in {args.dir} "
        f"(sha256 {record['sha256']})"
    )
    return 0


def prepare_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gr data prepare",
        description="Read the source a config's data section declares (csv, parquet: a file or a directory of "
        "partition files; ml-100k, ml-1m, ml-20m, amazon) and write a prepared dataset DIR: id maps, side "
        "tables and per-user sequence shards, for training with data.prepared: DIR. Any data key can be "
        "overridden by its dotted path, e.g. --data.path data/ml-1m --data.min_seq_len 5",
    )
    parser.add_argument(
        "--config",
        help="recipe YAML (its data: section is read); with --append optional, and then its "
        "prepared keys must be the dataset's",
    )
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="the prepared dataset to write")
    parser.add_argument(
        "--append",
        metavar="PARTITION",
        help="add the events of PARTITION (a file, a directory of partition files or a glob, as data.path) to "
        "the prepared dataset DIR: new shards, the maps and side tables extended; every event must be later "
        "than DIR's last (duckdb engine)",
    )
    parser.add_argument("--engine", choices=sorted(ENGINES), default="duckdb", help="default: duckdb")
    parser.add_argument(
        "--memory-limit", help="the engine's memory (duckdb: its memory_limit, default 4GB; spark: its heap, e.g. 8g)"
    )
    parser.add_argument("--threads", type=int, help="the engine's threads (spark: local[N]; default: one per core)")
    parser.add_argument(
        "--master",
        help="spark only: the cluster's master URL (yarn, spark://host:7077, k8s://...; default local[2]); "
        "the source and DIR must be on a filesystem every executor mounts at the same path",
    )
    parser.add_argument(
        "--users-per-shard", type=int, help="users per shard file (default: 16 row groups of 1024 users)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    return parser


def prepare(argv: Optional[Sequence[str]] = None) -> int:
    """``gr data prepare``: bad input ends in one line on stderr and exit status 2."""
    parser = prepare_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    overrides = parse_overrides(parser, rest)
    outside = [key for key, _ in overrides if not key.startswith("data.")]
    if outside:
        parser.error(f"--{outside[0]}: gr data prepare reads the data section only (override data.* keys)")
    if args.append is None and args.config is None:
        parser.error("the following arguments are required: --config (or --append PARTITION)")
    return run_cli("gr data prepare", lambda: (_append if args.append is not None else _prepare)(args, overrides))


def _engine_options(args: argparse.Namespace) -> Dict[str, Any]:
    """The engine function's keyword arguments from the command line (each engine names them its own way)."""
    options: Dict[str, Any] = {}
    if args.engine == "spark":
        if args.master and args.threads:
            raise ValueError("--master and --threads: give one (--threads N is --master local[N])")
        master = args.master or (f"local[{args.threads}]" if args.threads else None)
        options.update({"master": master} if master else {})
        options.update({"memory": args.memory_limit} if args.memory_limit else {})
    else:
        if args.master:
            raise ValueError(f"--master: only the spark engine runs on a cluster (got --engine {args.engine})")
        options.update(threads=args.threads)
        options.update({"memory_limit": args.memory_limit} if args.memory_limit else {})
    options["overwrite"] = args.overwrite
    if args.users_per_shard is not None:
        options["users_per_shard"] = args.users_per_shard
    return options


def _data_config(path: Optional[Path], base: Dict[str, Any], overrides: Sequence[Tuple[str, str]]) -> DataConfig:
    """The data section of the config file ``path`` (None: ``base``, a manifest's) with the overrides."""
    data = base
    if path is not None:
        section = read_recipe(path).get("data")
        data = section if isinstance(section, dict) else {}
    for dotted, text in overrides:
        apply_override({"data": data}, dotted, parse_value(text))
    try:
        return DataConfig.from_dict(data)
    except ValueError as error:
        given = " ".join(f"--{k} {v}" for k, v in overrides)
        where = f"{given} (command line, over {path or 'the manifest'})" if given else path
        raise ValueError(f"{where}: {error}") from None


def _append(args: argparse.Namespace, overrides: Sequence[Tuple[str, str]]) -> int:
    """``--append PARTITION``: DuckDB adds the partition to DIR (``append_with_duckdb``)."""
    if args.engine != "duckdb":
        raise ValueError(f"--append: the duckdb engine appends (got --engine {args.engine})")
    if args.overwrite:
        raise ValueError("--append adds to DIR, --overwrite replaces it: give one")
    if args.master:
        raise ValueError("--master: only the spark engine runs on a cluster, and --append runs on duckdb")
    from gr.data.prepared.duckdb_append import append_with_duckdb
    from gr.data.prepared.manifest import read_manifest

    config = None
    if args.config is not None or overrides:
        base = {} if args.config is not None else read_manifest(args.out).data
        config = _data_config(None if args.config is None else Path(args.config), base, overrides)
    options = _engine_options(args)
    options.pop("overwrite")
    stages = logging.getLogger("gr.data")
    level = stages.level
    stages.setLevel(logging.INFO)
    try:
        manifest = append_with_duckdb(args.out, args.append, config, **options)
    finally:
        stages.setLevel(level)
    entry = manifest.appends[-1]
    print(
        f"{args.out}: append {len(manifest.appends)} ({entry.path}): {entry.events:,} events, "
        f"{entry.users_added:,} new users, {entry.items_added:,} new items, "
        f"{sum(s.users for s in entry.shards):,} users in {len(entry.shards)} shards; now "
        f"{manifest.summary['users']:,} users, {manifest.summary['items']:,} items, "
        f"{manifest.summary['interactions']:,} interactions"
    )
    return 0


def _prepare(args: argparse.Namespace, overrides: Sequence[Tuple[str, str]]) -> int:
    module, function = ENGINES[args.engine]
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"--engine {args.engine}: this installation has no {module} module")
    path = Path(args.config)
    config = _data_config(path, {}, overrides)
    checked_output(args.out, [("--config", path), *config.inputs()], "--out")
    engine = getattr(importlib.import_module(module), function)
    stages = logging.getLogger("gr.data")
    level = stages.level
    stages.setLevel(logging.INFO)  # each stage's counts and seconds, while this command runs
    try:
        manifest = engine(config, args.out, **_engine_options(args))
    finally:
        stages.setLevel(level)
    summary = manifest.summary
    print(
        f"{args.out}: {summary['users']:,} users, {summary['items']:,} items, {summary['interactions']:,} "
        f"interactions in {len(manifest.shards)} shards ({args.engine} {manifest.engine_version})"
    )
    return 0
