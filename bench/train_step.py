"""Training speed of the ML-1M recipes at fp32 and bf16, on synthetic data of ML-1M's shape.

    python bench/train_step.py [--smoke] [--steps 8] [--users 6040] [--recipes small,large] [--no-epoch] [--epochs 1]
    python bench/train_step.py --smoke --profile     # where one step's time goes, per phase and op
    python bench/train_step.py --no-epoch --token-negatives   # the recipes against per-token negatives

ML-1M itself need not be on the machine: ``bench_data.write_ml1m_shaped_ratings`` writes a
``ratings.dat`` with its users, items and per-user lengths (mean 166, median 96, p90 400, max
2,314; the recipes cap histories at 200), and the recipes (configs/ml1m_hstu.yaml, 2 layers;
configs/ml1m_hstu_large.yaml, 8 layers) read it unchanged.

For each recipe and precision ("32-true", "bf16-mixed" = forward and loss under CPU bf16
autocast, as Lightning runs it, where gr's fused kernels multiply in bf16 math on fp32 activations):
* samples/s of full training steps (sampling, sharded lookup, HSTU, sampled softmax, backward
  with the fused embedding optimizer, dense AdamW) on the same batches, the precisions
  alternating step by step so that both see the same machine load;
* the fraction of the matmul peak of that precision (measured on square matmuls at the start of
  this run and again at its end; the higher of the two counts, so that a slow moment during one
  measurement cannot inflate the fractions) that the step's useful FLOPs reach: 3x the forward
  FLOPs of the projections, of attention over the keys each token sees (no padding) and of the
  sampled softmax's dot products;
* unless --no-epoch, one whole Lightning epoch (``gr.train``'s trainer: train, validation,
  checkpoint) and its validation part, in seconds, each in a process of its own as a training run
  has it; and the training steps inside that epoch (Lightning's loop), from the start of a batch to
  the end of its optimizer step, the first ``LOOP_WARMUP`` of each epoch untimed: ms a step and
  fraction of peak. With ``--epochs N`` that process trains N epochs and the numbers are their
  means (a run's steady state, less of one moment's machine noise).
  The step rates above alternate two models in one process that has run the other settings
  before, whose heaps and caches then meet each other's leftovers (thousands more page faults a
  step for the large recipe): they compare the precisions under the same load; the epoch's steps
  give the speed a training run has.
With ``--token-negatives`` the steps also alternate with the recipe changed to
``task.retrieval.negatives: token`` (a draw of negatives per token, the HSTU paper's sampling,
where the recipes share draws between tokens: the same useful FLOPs), reported as
"<precision>+token" with the recipe's speed-up over it. The load average is printed next to the
numbers; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Dict, List, Tuple

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gr.utils.devices import configure_onednn_cache  # noqa: E402

configure_onednn_cache()  # as `gr train` does

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _host import run_python  # noqa: E402
from _peak import matmul_peak  # noqa: E402
from bench_data import ML1M_RECIPES, write_ml1m_shaped_ratings  # noqa: E402
from lightning.pytorch import Callback  # noqa: E402
from train_dedup import build, train_step  # noqa: E402

from gr.data.datamodule import SequenceDataModule  # noqa: E402
from gr.ops.native import native_ops  # noqa: E402
from gr.train.config import TrainConfig, load_config  # noqa: E402
from gr.train.memory import hstu_forward_flops_per_token, linear_flops  # noqa: E402
from gr.train.module import GRTrainingModule  # noqa: E402
from gr.train.run import make_trainer  # noqa: E402

PRECISIONS = ("32-true", "bf16-mixed")


def load() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def training_flops(config: TrainConfig, model: torch.nn.Module, batch) -> float:
    """Useful FLOPs of one training step (3x forward): projections and DNNs per token,
    attention over the keys each token sees, sampled softmax dot products per scored token."""
    hstu = config.model.hstu
    lengths = (batch.seq_offsets[1:] - batch.seq_offsets[:-1]).tolist()
    forward = sum(n * hstu_forward_flops_per_token(hstu, n) for n in lengths)
    forward += sum(lengths) * (linear_flops(model.prefix_dnn) + linear_flops(model.postfix_dnn))
    retrieval = config.task.retrieval
    scored = int((batch.labels["next_item"] >= 0).sum())
    forward += scored * 2 * config.model.tables[0]["embedding_dim"] * (retrieval.num_negatives + 1)
    return 3.0 * forward


LOOP_WARMUP = 2  # training steps of the epoch not timed: the first allocate and build what the rest reuse


class EpochClock(Callback):
    """Seconds from the first train epoch's start to the end of fit, and of the validation epochs; the
    training steps' seconds and useful FLOPs after the first ``LOOP_WARMUP`` of each epoch."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.steps: List[float] = []
        self.flops: List[float] = []
        self.validation = 0.0

    def on_train_epoch_start(self, trainer, module) -> None:
        if trainer.current_epoch == 0:
            self.start = time.perf_counter()

    def on_train_batch_start(self, trainer, module, batch, batch_idx: int) -> None:
        self.step_start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx: int) -> None:
        if batch_idx >= LOOP_WARMUP:
            self.steps.append(time.perf_counter() - self.step_start)
            self.flops.append(training_flops(self.config, module.gr_model, batch))

    def on_validation_epoch_start(self, trainer, module) -> None:
        self.validation_start = time.perf_counter()

    def on_validation_epoch_end(self, trainer, module) -> None:
        self.validation += time.perf_counter() - self.validation_start


def epoch_seconds(config: TrainConfig, out_dir: Path) -> Dict[str, float]:
    """-> an epoch's seconds and its validation's (means over ``trainer.max_epochs``), and the timed
    training steps' count, seconds and useful FLOPs."""
    data = SequenceDataModule(config.data)
    data.setup()
    module = GRTrainingModule(config, data.feature_spec(), data.tasks, data.popularity())
    trainer, _ = make_trainer(config, out_dir)
    clock = EpochClock(config)
    trainer.callbacks.append(clock)
    trainer.fit(module, datamodule=data)
    epochs = config.trainer.max_epochs
    return {
        "epoch_s": (time.perf_counter() - clock.start) / epochs,
        "validation_s": clock.validation / epochs,
        "loop_steps": len(clock.steps),
        "loop_seconds": sum(clock.steps),
        "loop_flops": sum(clock.flops),
    }


def in_own_process(*flags: str, echo: bool = False, forked: bool = False) -> Dict:
    """This script run with ``flags`` by a fresh process, as a training run has it (what ran before
    stays out of its heap), or with ``forked`` (a smoke run) by a child of this one
    (``_host.run_python``) -> the JSON object its last line prints; with ``echo`` the lines before
    it (profiles) are printed here."""
    done = run_python([__file__, *flags], forked)
    if done.returncode != 0:
        raise RuntimeError(f"train_step.py {' '.join(flags)} failed:\n{done.stderr[-4000:]}")
    *lines, last = done.stdout.strip().splitlines()
    if echo:
        print("\n".join(lines), flush=True)
    return json.loads(last)


def recipe_config(recipe: str, work: Path, *overrides: Tuple[str, str]) -> TrainConfig:
    """The ML-1M ``recipe`` reading ``work``'s data, with ``overrides``."""
    path = Path(__file__).resolve().parents[1] / ML1M_RECIPES[recipe]
    return load_config(path, [("data.path", str(work)), *overrides])


def epoch_run(recipe: str, precision: str, work: Path, epochs: int) -> None:
    """--epoch-run: ``epochs`` whole epochs of ``recipe`` at ``precision``; prints epoch_seconds as JSON."""
    config = recipe_config(
        recipe,
        work,
        ("trainer.max_epochs", str(epochs)),
        ("trainer.precision", precision),
        ("trainer.enable_progress_bar", "false"),
    )
    print(json.dumps(epoch_seconds(config, work / f"run_{recipe}_{precision}")))


def rates_run(recipe: str, work: Path, steps: int, peaks: Dict[str, float], token: bool, profile: bool) -> None:
    """--rates-run: step_rates of ``recipe`` (and with per-token negatives if ``token``); prints them as JSON."""
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1)
    configs = {"recipe": recipe_config(recipe, work)}
    if token:
        configs["token"] = recipe_config(recipe, work, ("task.retrieval.negatives", "token"))
    rates = step_rates(configs, steps, peaks, profile)
    if profile:
        print_profiles(steps)
    dist.destroy_process_group()
    print(json.dumps(rates))


def step_rates(
    configs: Dict[str, TrainConfig], steps: int, peaks: Dict[str, float], profile: bool
) -> Dict[str, Dict[str, float]]:
    """Per setting ("<precision>" for ``configs["recipe"]``, "<precision>+<name>" for the others):
    samples/s and fraction of that precision's matmul peak over ``steps`` steps, all settings
    alternating step by step."""
    config = configs["recipe"]
    data = SequenceDataModule(config.data)
    data.setup()
    spec = data.feature_spec()
    epoch = list(data.train_dataloader())
    batches = [epoch[i % len(epoch)] for i in range(steps + 1)]  # cycled when the data has fewer
    settings = {
        (p if name == "recipe" else f"{p}+{name}"): (p, build(c, spec))
        for name, c in configs.items()
        for p in PRECISIONS
    }
    seconds = {s: 0.0 for s in settings}
    generator = torch.Generator()
    for step, batch in enumerate(batches):  # step 0 warms up
        for name, (precision, setup) in settings.items():
            generator.manual_seed(step)
            profiler = profiled(name, setup[0]) if profile and step else nullcontext()
            start = time.perf_counter()
            with profiler:
                train_step(*setup, batch, generator, precision)
            if step:
                seconds[name] += time.perf_counter() - start
    timed = batches[1:]
    samples = sum(int(b.seq_offsets.numel() - 1) for b in timed)
    flops = sum(training_flops(config, settings[PRECISIONS[0]][1][0].module, b) for b in timed)
    return {
        name: {
            "samples_per_s": samples / seconds[name],
            "step_ms": 1000 * seconds[name] / steps,
            "gflops": flops / seconds[name] / 1e9,
            "peak_fraction": flops / seconds[name] / 1e9 / peaks[precision],
        }
        for name, (precision, _) in settings.items()
    }


PROFILES: Dict[str, List] = {}
PHASE_MODULES = ("embeddings", "prefix_dnn", "hstu", "postfix_dnn")  # GRModel children timed in forward
BACKWARD_GROUPS = {
    "attention": ("_ChunkedAttention", "_FusedAttention"),
    "sampled softmax": ("_DenseSampledSoftmax", "_FusedSampledSoftmax"),
    "embedding lookup + fused optimizer": ("SplitNoBagLookupFunction", "SplitLookupFunction"),
}


def profiled(precision: str, dmp) -> object:
    """A profiler for one step, with forward phases of ``dmp``'s GRModel labelled."""
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    PROFILES.setdefault(precision, []).append(profiler)
    model = dmp.module
    if not getattr(model, "_phase_hooks", False):
        for name in PHASE_MODULES:
            labels: List = []
            module = getattr(model, name)
            module.register_forward_pre_hook(
                lambda m, a, n=name, s=labels: s.append(
                    torch.autograd.profiler.record_function(f"phase: forward {n}").__enter__()
                )
            )
            module.register_forward_hook(lambda m, a, o, s=labels: s.pop().__exit__(None, None, None))
        model._phase_hooks = True
    return profiler


def print_profiles(steps: int) -> None:
    """Per precision: ms per step of each phase (inclusive), backward by group, then the top ops."""
    for precision, profilers in PROFILES.items():
        inclusive: Dict[str, float] = {}
        own: Dict[str, float] = {}
        for profiler in profilers:
            for event in profiler.key_averages():
                inclusive[event.key] = inclusive.get(event.key, 0.0) + event.cpu_time_total
                own[event.key] = own.get(event.key, 0.0) + event.self_cpu_time_total
        print(f"--- {precision}: ms per step")
        for key in sorted(k for k in inclusive if k.startswith("phase: ")):
            print(f"{inclusive[key] / 1000 / steps:9.2f}  {key[7:]}")
        backward = {k: v for k, v in inclusive.items() if k.startswith("autograd::engine::evaluate_function: ")}
        for group, names in BACKWARD_GROUPS.items():
            total = sum(v for k, v in backward.items() if any(n in k for n in names))
            print(f"{total / 1000 / steps:9.2f}  backward {group} (in 'backward')")
        names = [n for group in BACKWARD_GROUPS.values() for n in group]
        grouped = sum(v for k, v in backward.items() if any(n in k for n in names))
        other = next(v for k, v in inclusive.items() if k.startswith("phase: backward")) - grouped
        print(f"{other / 1000 / steps:9.2f}  backward of the rest: projections, norms, dropout (in 'backward')")
        print(f"--- {precision}: self CPU ms per step, top ops")
        for key, micros in sorted(own.items(), key=lambda kv: -kv[1])[:20]:
            print(f"{micros / 1000 / steps:9.2f}  {key}")


def summarise_against_both_peaks(result: Dict, start: Dict[str, float], end: Dict[str, float]) -> None:
    """Every fraction of peak in ``result`` again, of the higher of the start's and the end's peak per
    precision (in place, with both peaks kept), and printed."""
    peaks = {p: max(start[p], end[p]) for p in PRECISIONS}
    result.update({"peak_gflops": peaks, "peak_gflops_start": start, "peak_gflops_end": end})
    print(
        f"matmul peak at the end fp32 {end['32-true']:.0f}, bf16 {end['bf16-mixed']:.0f} GFLOP/s; "
        f"of the higher of the two (fp32 {peaks['32-true']:.0f}, bf16 {peaks['bf16-mixed']:.0f}):"
    )
    for key in [k for k in result if k.endswith("gflops") and "/" in k]:
        recipe, setting, measure = key.split("/")
        fraction = result[key] / peaks[setting.split("+")[0]]
        result[key.replace("gflops", "peak_fraction")] = fraction
        what = "its epoch's steps" if measure.startswith("loop") else "step rate"
        print(f"  {recipe:5s} {setting:16s} {what:17s} {100 * fraction:4.1f}% of peak")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="120 users, 2 steps, the fp32 epoch only: checks that the bench runs"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed training steps per precision (24, half an ML-1M epoch; smoke 2)"
    )
    parser.add_argument("--users", type=int, default=None, help="synthetic users (6040, ML-1M's; smoke 120)")
    parser.add_argument("--recipes", default="small,large", help=f"comma-separated of {sorted(ML1M_RECIPES)}")
    parser.add_argument("--no-epoch", action="store_true", help="skip the whole-epoch timings")
    parser.add_argument(
        "--epochs", type=int, default=1, help="epochs each epoch-timing process trains; its numbers are their means"
    )
    parser.add_argument("--profile", action="store_true", help="profile the timed steps, print the top ops")
    parser.add_argument(
        "--token-negatives", action="store_true", help="also time the recipes with a draw of negatives per token"
    )
    parser.add_argument("--epoch-run", default=None, help=argparse.SUPPRESS)  # "recipe,precision": be that run
    parser.add_argument("--rates-run", default=None, help=argparse.SUPPRESS)  # a recipe: be its step rates
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--peaks", default=None, help=argparse.SUPPRESS)  # JSON: the parent's peaks
    args = parser.parse_args()
    if args.epoch_run is not None:
        return epoch_run(*args.epoch_run.split(","), Path(args.work), args.epochs)
    if args.rates_run is not None:
        peaks = json.loads(args.peaks)
        return rates_run(args.rates_run, Path(args.work), args.steps, peaks, args.token_negatives, args.profile)
    steps = args.steps or (2 if args.smoke else 24)
    users = args.users or (120 if args.smoke else 6040)
    recipes = args.recipes.split(",")
    unknown = [r for r in recipes if r not in ML1M_RECIPES]
    if unknown:
        parser.error(f"--recipes: unknown {unknown}; expected names from {sorted(ML1M_RECIPES)}")
    if args.epochs < 1:
        parser.error(f"--epochs: expected an int >= 1, got {args.epochs}")
    mean = f" (mean of {args.epochs})" if args.epochs > 1 else ""
    work = Path(tempfile.mkdtemp(prefix="train_step_"))
    native_ops("gr_cpu_fused")  # a first build (~1 min) here, not inside the first timed epoch
    ratings = write_ml1m_shaped_ratings(work, users)
    # smoke: a small matmul, since a 1024^3 bf16 one takes ~5 s where bf16 is emulated
    peak_seconds, peak_size = (0.2, 256) if args.smoke else (1.0, 1024)

    def measure_peaks() -> Dict[str, float]:
        """fp32 and bf16 peaks; bf16-mixed's is the higher of the two: on a CPU without bf16
        instructions, bf16 matmuls are emulated (~1 GFLOP/s) and gr's kernels compute in fp32."""
        fp32, bf16 = (matmul_peak(dtype, peak_seconds, peak_size) for dtype in (torch.float32, torch.bfloat16))
        return {"32-true": fp32, "bf16-mixed": max(fp32, bf16)}

    peaks = measure_peaks()
    print(
        f"{users} users, {ratings} ratings; matmul peak fp32 {peaks['32-true']:.0f} GFLOP/s, "
        f"bf16 {peaks['bf16-mixed']:.0f} GFLOP/s (the % below are of these; the summary at the end "
        f"takes the higher of these and the end's); {load()}",
        flush=True,
    )
    result = {
        "users": users,
        "ratings": ratings,
        "steps": steps,
        "threads": torch.get_num_threads(),
        "epochs": args.epochs,
        "peak_gflops": peaks,
        "load_before": os.getloadavg(),
    }
    for recipe in recipes:
        # smoke: one epoch-timing process (fp32); the step rates below still run both precisions
        epoch_precisions = () if args.no_epoch else PRECISIONS[:1] if args.smoke else PRECISIONS
        for precision in epoch_precisions:
            timing = in_own_process(
                "--epoch-run",
                f"{recipe},{precision}",
                "--work",
                str(work),
                "--epochs",
                str(args.epochs),
                forked=args.smoke,
            )
            loop = {"step_ms": 0.0, "gflops": 0.0, "peak_fraction": 0.0}
            if timing["loop_steps"]:
                loop["step_ms"] = 1000 * timing["loop_seconds"] / timing["loop_steps"]
                loop["gflops"] = timing["loop_flops"] / timing["loop_seconds"] / 1e9
                loop["peak_fraction"] = loop["gflops"] / peaks[precision]
            result[f"{recipe}/{precision}/epoch_s"] = timing["epoch_s"]
            result[f"{recipe}/{precision}/validation_s"] = timing["validation_s"]
            result.update({f"{recipe}/{precision}/loop_{k}": v for k, v in loop.items()})
            print(
                f"{recipe:5s} {precision:10s} epoch {timing['epoch_s']:6.2f} s{mean} (validation "
                f"{timing['validation_s']:.2f} s); its training steps {loop['step_ms']:.1f} ms "
                f"= {100 * loop['peak_fraction']:4.1f}% of peak; {load()}",
                flush=True,
            )
        flags = ["--rates-run", recipe, "--work", str(work), "--steps", str(steps), "--peaks", json.dumps(peaks)]
        flags += ["--token-negatives"] * args.token_negatives + ["--profile"] * args.profile
        rates = in_own_process(*flags, echo=args.profile, forked=args.smoke)
        for precision, rate in rates.items():
            result.update({f"{recipe}/{precision}/{k}": v for k, v in rate.items()})
            print(
                f"{recipe:5s} {precision:16s} {rate['samples_per_s']:7.1f} samples/s, "
                f"{rate['step_ms']:7.1f} ms/step, "
                f"{rate['gflops']:6.1f} GFLOP/s = {100 * rate['peak_fraction']:4.1f}% of peak; {load()}",
                flush=True,
            )
        result[f"{recipe}/bf16_speedup"] = (
            result[f"{recipe}/bf16-mixed/samples_per_s"] / result[f"{recipe}/32-true/samples_per_s"]
        )
        if args.token_negatives:
            result[f"{recipe}/speedup_over_token_negatives"] = (
                result[f"{recipe}/32-true/samples_per_s"] / result[f"{recipe}/32-true+token/samples_per_s"]
            )
            speedup = result[f"{recipe}/speedup_over_token_negatives"]
            print(f"{recipe:5s} the recipe runs {speedup:.2f}x the speed of per-token negatives (fp32)")
    summarise_against_both_peaks(result, peaks, measure_peaks())
    result["load_after"] = os.getloadavg()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
