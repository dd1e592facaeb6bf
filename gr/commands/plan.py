"""``gr plan --config X.yaml --nproc N [--memory-gib G] [--section.key value ...]``: the estimate of
``gr.train.memory`` printed.

The memory and work of a training run before it starts: parameters, activations, FLOPs per token and
peak memory per rank (what is counted: ``gr.train.memory``), and whether one rank's share fits in
``--memory-gib``."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Optional, Sequence

from gr.commands.train import parse_overrides
from gr.train.config import TrainConfig, load_config

if TYPE_CHECKING:
    from gr.train.memory import Plan


def format_plan(plan: Plan, config: TrainConfig, memory_gib: Optional[float]) -> str:
    from gr.train.memory import GIB, RUNTIME_OVERHEAD_BYTES, rank_batch  # loaded by the plan already

    lines = [
        f"ranks: {plan.nproc}   tokens per sample: {plan.tokens_per_sample}   "
        f"batch per rank: {rank_batch(config, plan.nproc)} (global {config.data.batch_size})",
        f"sparse parameters: {plan.sparse_params:,}",
    ]
    for t in plan.tables:
        lines.append(
            f"  {t.name}: {t.rows:,} x {t.dim} ({t.sharding}) = {t.params:,}; per rank "
            f"{', '.join(f'{p:,}' for p in t.params_per_rank)}"
        )
    lines.append(
        f"dense parameters: {sum(plan.dense_params.values()):,} "
        f"({', '.join(f'{k} {v:,}' for k, v in plan.dense_params.items())}); per rank "
        f"{', '.join(f'{p:,}' for p in plan.dense_params_per_rank)} "
        f"(dense_sharding: {config.distributed.dense_sharding})"
    )
    lines.append("HSTU activation memory per sample (kept after forward / peak in backward):")
    for precision, modes in plan.activation_bytes.items():
        cells = [f"{m} {_mib(v)} / {_mib(plan.activation_peak_bytes[precision][m])}" for m, v in modes.items()]
        lines.append(f"  {precision:>10}: " + "   ".join(cells))
    lines.append(
        f"FLOPs per token: forward HSTU {plan.forward_flops_per_token['hstu']:,} + DNN linear "
        f"{plan.forward_flops_per_token['dnn']:,}; training ~{plan.training_flops_per_token:,} "
        f"(3x forward + recompute {config.model.hstu.recompute!r})"
    )
    need = max(plan.memory_bytes_per_rank)
    rank = plan.memory_bytes_per_rank.index(need)
    sparse = plan.sparse_memory_per_rank[rank]
    lines.append(
        f"memory per rank (peak resident set, recompute {config.model.hstu.recompute!r}, "
        f"{config.trainer.precision}): {need / GIB:.3f} GiB"
    )
    lines.append(
        f"  process {_gib(plan.process_bytes)} (measured: libraries, data) + runtime {_gib(RUNTIME_OVERHEAD_BYTES)}"
        f" + weights, gradients, optimizer state {_gib(plan.state_bytes_per_rank[rank])} + "
        f"{plan.sparse_backend}'s table copies {_gib(sparse.backend)} + largest transient "
        f"{_gib(plan.transient_bytes_per_rank[rank])} (building tables {_gib(sparse.build)}, checkpoint "
        f"{_gib(sparse.checkpoint)}, batch activations {_gib(plan.batch_activation_bytes)})"
    )
    if memory_gib is not None:
        verdict = "fits" if need <= memory_gib * GIB else "does NOT fit"
        lines.append(f"{verdict} in {memory_gib} GiB per rank")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="gr plan", description=__doc__.split("\n\n")[1])
    parser.add_argument("--config", required=True, help="recipe YAML (as for train.py)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks to shard over (default 1)")
    parser.add_argument("--memory-gib", type=float, help="memory per rank to check the plan against")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    overrides = parse_overrides(parser, rest)
    from gr.train.memory import plan_from_config  # the training stack (torch, Lightning): once the arguments parse

    try:
        config = load_config(args.config, overrides)
        plan = plan_from_config(config, args.nproc)
    except (ValueError, FileNotFoundError) as error:
        print(f"gr.plan: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(plan), "memory_bytes_per_rank": plan.memory_bytes_per_rank}))
    else:
        print(format_plan(plan, config, args.memory_gib))
    return 0


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.3f} GiB"


if __name__ == "__main__":
    sys.exit(main())
