"""The ``gr train`` (alias ``train.py``) command line:
``--config X.yaml [--out DIR] [--resume DIR] [--print-config] [--section.key value ...]``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from gr.train.config import TrainConfig, config_yaml, load_config
from gr.train.config_reference import format_reference
from gr.utils.cli_errors import run_cli
from gr.utils.outputs import checked_output


def parse_args(argv: Sequence[str], prog: str = "gr train") -> Tuple[argparse.Namespace, List[Tuple[str, str]]]:
    """-> (namespace with config/out/resume/print_config, [(dotted.key, value text), ...])."""
    parser = argparse.ArgumentParser(
        prog=prog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=format_reference(),
        description="Train a generative recommender. Any config key can be overridden by its dotted path, "
        "e.g. --trainer.max_epochs 3 --data.path data/ml-100k",
    )
    parser.add_argument("--config", help="recipe YAML (default with --resume: the run's config.yaml)")
    parser.add_argument("--out", help="run directory (default: runs/<config name>)")
    parser.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its last checkpoint")
    parser.add_argument(
        "--init-from",
        metavar="RUN",
        help="start from a trained run's model on this config's data (trainer.init_from): its id maps grow; "
        "the run follows the config's warm_start recipe",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (YAML, every key) and exit without training",
    )
    args, rest = parser.parse_known_args(list(argv))
    overrides = parse_overrides(parser, rest)
    if args.init_from is not None:
        overrides.append(("trainer.init_from", args.init_from))
    if args.config is None and args.resume is None:
        parser.error("--config is required (or --resume DIR)")
    if args.resume and args.out and Path(args.out).resolve() != Path(args.resume).resolve():
        parser.error("--resume continues the run in its own directory; drop --out")
    return args, overrides


def parse_overrides(parser: argparse.ArgumentParser, rest: Sequence[str]) -> List[Tuple[str, str]]:
    """The arguments ``parser`` left over -> [(dotted.key, value text), ...]; errors through ``parser``."""
    overrides: List[Tuple[str, str]] = []
    i = 0
    while i < len(rest):
        token = rest[i]
        if not token.startswith("--") or len(token) == 2:
            parser.error(f"unexpected argument {token!r}: overrides look like --section.key value")
        key, sep, value = token[2:].partition("=")
        if not sep:
            if i + 1 >= len(rest):
                parser.error(f"--{key}: missing value")
            value = rest[i + 1]
            i += 1
        overrides.append((key, value))
        i += 1
    return overrides


def resolve(argv: Sequence[str], prog: str = "gr train") -> Tuple[TrainConfig, Path, bool]:
    """-> (validated config, run directory, resume?); the data it names is found (FileNotFoundError
    naming what is missing) and the run directory lies apart from it and from ``--init-from``
    (``gr.utils.outputs``), all before the training stack is imported."""
    from gr.data.prepared.manifest import prepared_directory  # the data readers (pyarrow): once arguments parse
    from gr.data.readers import find_source

    args, overrides = parse_args(argv, prog)
    if args.resume:
        config_path = Path(args.config) if args.config else Path(args.resume) / "config.yaml"
        config, out, resume = load_config(config_path, overrides), Path(args.resume), True
    else:
        config, resume = load_config(args.config, overrides), False
        out = Path(args.out) if args.out else Path("runs") / Path(args.config).stem
        if (out / "metrics.json").exists() or (out / "checkpoints").exists():
            raise ValueError(f"{out} already holds a run; pass another --out, or --resume {out} to continue it")
    inputs = [*config.data.inputs(), ("--init-from", config.trainer.init_from)]
    checked_output(out, inputs, "--resume" if resume else "--out")
    if prepared_directory(config.data) is None:
        find_source(config.data)
    return config, out, resume


def main(argv: Optional[Sequence[str]] = None, prog: str = "gr train") -> int:
    """``gr train``: bad input (config, data files, a run to resume, a diverged run) ends in one
    line on stderr and exit status 2 (``gr.utils.cli_errors``)."""
    import sys

    return run_cli(prog, lambda: _train(sys.argv[1:] if argv is None else argv, prog))


def _train(argv: Sequence[str], prog: str) -> int:
    import json

    args, overrides = parse_args(argv, prog)
    if args.print_config:
        config_path = Path(args.config) if args.config else Path(args.resume) / "config.yaml"
        print(config_yaml(load_config(config_path, overrides)), end="")
        return 0
    config, out, resume = resolve(argv, prog)
    import torch.distributed as dist

    from gr.train.run import METRICS_FILE, RunComplete, train  # Lightning: not for --help / --print-config

    callbacks = []
    if config.trainer.publish_every is not None:
        from gr.export.publish import Publisher  # the export stack: only a run that publishes imports it

        callbacks.append(Publisher(config.self_contained(), out))
    try:
        metrics = train(config, out, resume=resume, callbacks=callbacks)
    except RunComplete as done:
        print(f"{prog}: {done}")
        return 0
    if not dist.is_initialized() or dist.get_rank() == 0:  # rank 0 wrote metrics.json; torchrun's others agree
        summary = {k: v for k, v in metrics.items() if k != "config"}
        print(json.dumps(summary, indent=2))
        print(f"wrote {out / METRICS_FILE}")
        if not config.data.validates:
            print(
                f"nothing was held out (data.split none); judge the run on later events with: gr evaluate {out} "
                "--data.path LATER --data.split time --data.split_time SECONDS"
            )
    end_process_group()
    return 0


def end_process_group() -> None:
    """Destroy the torch.distributed group (torchrun) before the interpreter exits: left to
    interpreter shutdown, gloo's threads sometimes abort the process ("terminate called
    without an active exception", exit -6) after the run has finished."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
