"""Training-step time of this checkout against another one, paired: the A/B a shared machine needs.

    python bench/ab_steps.py --against ../gr-before [--recipe small] [--precision 32-true] [--rounds 16] [--steps 10]
    python bench/ab_steps.py --smoke      # against itself, 400 users, step processes forked: checks that it runs

Whole-benchmark runs drift by 10-20 % within minutes on a shared 2-core machine, more than most
changes. Here two long-lived processes, one per checkout (its ``gr``, its ``bench/train_dedup.py``
and its recipe; the other checkout's kernels built in a directory of their own), are set up once on
the same synthetic data of ML-1M's shape (``bench_data.write_ml1m_shaped_ratings``) and then
alternated: ``--steps`` training steps of one, then of the other, ``--rounds`` times, the order
swapped every round, one process running at a time. Prints each round's ms per step and the median
of the per-round ratios this / other. The last line is one JSON object: recipe, precision, users,
rounds, steps, this_ms, other_ms (per round), this_median_ms, other_median_ms, median_ratio,
mean_ratio, this_faster_rounds, load_before, load_after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import smoke  # noqa: E402
from bench_data import ML1M_RECIPES, ML1M_USERS, write_ml1m_shaped_ratings  # noqa: E402

WARMUP_STEPS = 3  # kernels loaded, allocator and caches settled before the first timed round


def serve(checkout: Path, recipe: str, data: str, precision: str) -> None:
    """The step process of one checkout: after "ready", each stdin line N runs N steps and answers ms per step."""
    sys.path[:0] = [str(checkout), str(checkout / "bench")]
    from gr.utils.devices import configure_onednn_cache

    configure_onednn_cache()  # as `gr train` does
    import torch
    import torch.distributed as dist
    from train_dedup import build, train_step

    from gr.data.datamodule import SequenceDataModule
    from gr.train.config import load_config

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
    config = load_config(recipe, [("data.path", data)])
    datamodule = SequenceDataModule(config.data)
    datamodule.setup()
    batches = list(datamodule.train_dataloader())
    setup = build(config, datamodule.feature_spec())
    generator = torch.Generator()
    done = 0

    def run(steps: int) -> None:
        nonlocal done
        for _ in range(steps):
            generator.manual_seed(done)
            train_step(*setup, batches[done % len(batches)], generator, precision)
            done += 1

    run(WARMUP_STEPS)
    print("ready", flush=True)
    for line in sys.stdin:
        start = time.perf_counter()
        run(int(line))
        print(f"{1000 * (time.perf_counter() - start) / int(line):.3f}", flush=True)


class ForkedSteps:
    """A step process forked from this one (``--smoke`` against this checkout: its numbers mean
    nothing, and this process has the checkout's code imported): ``serve`` on pipes that stand in for
    its stdin and stdout, read and written as ``subprocess.Popen``'s."""

    def __init__(self, checkout: Path, config: Path, data: Path, precision: str, siblings: List["ForkedSteps"]) -> None:
        to_child, from_parent = os.pipe()
        to_parent, from_child = os.pipe()
        sys.stdout.flush()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns
            code = 1
            try:
                for sibling in siblings:  # their pipes' copies here would keep them from ever seeing EOF
                    sibling.stdin.close()
                    sibling.stdout.close()
                os.close(from_parent)
                os.close(to_parent)
                sys.stdin, sys.stdout = os.fdopen(to_child), os.fdopen(from_child, "w")
                serve(checkout, str(config), str(data), precision)
                code = 0
            finally:
                sys.stdout.flush()
                os._exit(code)
        os.close(to_child)
        os.close(from_child)
        self.stdin, self.stdout = os.fdopen(from_parent, "w"), os.fdopen(to_parent)

    def wait(self) -> int:
        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])

    def kill(self) -> None:
        os.kill(self.pid, 9)


def start(
    checkout: Path, args: argparse.Namespace, data: Path, extensions: Optional[Path], started: Dict[str, Any]
) -> "subprocess.Popen | ForkedSteps":
    """The step process of ``checkout``, ready (``started``: the step processes started before it)."""
    config = checkout / ML1M_RECIPES[args.recipe]
    process: "subprocess.Popen | ForkedSteps"
    if args.smoke and checkout == Path(__file__).resolve().parents[1]:
        siblings = [p for p in started.values() if isinstance(p, ForkedSteps)]
        process = ForkedSteps(checkout, config, data, args.precision, siblings)
    else:
        env = dict(os.environ, PYTHONPATH=str(checkout))
        if extensions is not None:
            env["GR_EXTENSIONS_DIR"] = str(extensions)
        command = [sys.executable, __file__, "--serve", str(checkout), "--config", str(config)]
        command += ["--precision", args.precision, "--data", str(data)]
        process = subprocess.Popen(
            command, cwd=checkout, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
    answer = process.stdout.readline().strip()
    if answer != "ready":
        process.kill()
        raise RuntimeError(f"{checkout}: its step process did not start (said {answer!r}; its error is above)")
    return process


def steps_ms(process: "subprocess.Popen | ForkedSteps", steps: int) -> float:
    process.stdin.write(f"{steps}\n")
    process.stdin.flush()
    return float(process.stdout.readline())


def checkout_dir(path: str, parser: argparse.ArgumentParser) -> Path:
    checkout = Path(path).resolve()
    if not (checkout / "gr").is_dir() or not (checkout / "bench" / "train_dedup.py").is_file():
        parser.error(f"--against {path}: expected a gr checkout (with gr/ and bench/train_dedup.py)")
    return checkout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default=None, help="the other checkout (default: this one, against itself)")
    parser.add_argument("--recipe", default="small", choices=sorted(ML1M_RECIPES))
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--rounds", type=int, default=16, help="alternations (smoke 2)")
    parser.add_argument("--steps", type=int, default=10, help="training steps of each checkout per round (smoke 1)")
    parser.add_argument("--users", type=int, default=ML1M_USERS, help="synthetic users (ML-1M's; smoke 400)")
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # a checkout: be its step process
    parser.add_argument("--config", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args, _ = smoke.parse_args(parser, {"rounds": 2, "steps": 1, "users": 400})
    if args.serve is not None:
        return serve(Path(args.serve), args.config, args.data, args.precision)

    this = Path(__file__).resolve().parents[1]
    other = checkout_dir(args.against, parser) if args.against else this
    work = Path(tempfile.mkdtemp(prefix="ab_steps_"))
    write_ml1m_shaped_ratings(work, args.users)
    print(f"{this} against {other}: {args.recipe} recipe, {args.precision}, {args.users} users", flush=True)
    processes: Dict[str, Any] = {}
    processes["this"] = start(this, args, work, None, processes)
    processes["other"] = start(other, args, work, None if other == this else work / "other_extensions", processes)
    load_before = os.getloadavg()
    times: Dict[str, List[float]] = {"this": [], "other": []}
    try:
        for round_ in range(args.rounds):
            for name in ("this", "other") if round_ % 2 == 0 else ("other", "this"):
                times[name].append(steps_ms(processes[name], args.steps))
            print(f"round {round_ + 1}: this {times['this'][-1]:.1f} ms, other {times['other'][-1]:.1f} ms", flush=True)
    finally:
        for process in processes.values():
            process.stdin.close()
            process.wait()
    ratios = [a / b for a, b in zip(times["this"], times["other"])]
    result = {
        "recipe": args.recipe,
        "precision": args.precision,
        "users": args.users,
        "rounds": args.rounds,
        "steps": args.steps,
        "this_ms": times["this"],
        "other_ms": times["other"],
        "this_median_ms": statistics.median(times["this"]),
        "other_median_ms": statistics.median(times["other"]),
        "median_ratio": statistics.median(ratios),
        "mean_ratio": statistics.mean(ratios),
        "this_faster_rounds": sum(r < 1.0 for r in ratios),
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    print(
        f"this / other, ms a step: median ratio {result['median_ratio']:.3f} (mean {result['mean_ratio']:.3f}), "
        f"this faster in {result['this_faster_rounds']} of {args.rounds} rounds; medians "
        f"{result['this_median_ms']:.1f} / {result['other_median_ms']:.1f} ms; load average "
        "%.2f %.2f %.2f" % result["load_after"]
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
