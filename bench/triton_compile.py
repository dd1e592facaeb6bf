"""Ahead-of-time compile of every Triton attention kernel variant, for a GPU target, on this CPU.

    python bench/triton_compile.py --arch sm_90            # every variant; about 5 minutes here
    python bench/triton_compile.py --arch sm_80 --smoke    # three variants (tests)
    python bench/triton_compile.py --arch sm_90 --recipe configs/ml1m_hstu.yaml --only-recipe

The variants are what training and serving launch, assembled by the launcher's own argument
code (``gr.hstu.kernels.attention.triton.host``) on CPU tensors and specialized by Triton's own binder,
so a variant here is one compile there: the forward, dq and dk/dv passes, and the cached-attention
kernel of serving (``cached_forward``: new tokens over K/V read through page tables); fp32 and bf16;
each bias part (position, time with log or sqrt buckets); the mask and norm switches (targets,
contextual prefix, look-back window, next-event query times, per-position norm), which are
runtime scalars and so share their variant; head dims 64, and 50 and 128 with both bias parts
(a dim that is not a multiple of 16 loads element by element; above 64 the table's wide column
applies); at the default tile configuration and at each autotuning candidate
(``gr.hstu.kernels.attention.triton.tuning``). Launches that compile to the same kernel are compiled once
and listed together.

Per variant: compile seconds (Triton front end to cubin, ptxas included), registers per
thread, local and stack bytes (``cuobjdump --dump-resource-usage``; ptxas puts spilled registers
in the stack frame, so either one non-zero is a spill) and shared memory per block.
``--recipe`` adds the variants each recipe launches (its bias parts, head dims, precision and the
default tiles; training and serving) and their total. Each compile starts from an empty Triton
cache. The load average is printed with the numbers (the machine is shared: compile seconds
grow with it). The last line is one JSON object: bench, arch, triton, variants, launches,
max_compile_s, total_compile_s, spills (variants that spill), max_registers, max_shared_bytes,
load_average, and with --recipe ``recipes``: per recipe its variants, total_compile_s,
max_compile_s and spills.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU target, not the CPU interpreter

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Dict, List, Optional, Tuple  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from torch import Tensor  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from gr.hstu.kernels.attention.common import AttentionCall, RelativeBias  # noqa: E402
from gr.hstu.kernels.attention.triton import tuning  # noqa: E402
from gr.hstu.kernels.attention.triton.cuda import CudaLayout  # noqa: E402
from gr.hstu.kernels.attention.triton.host import (  # noqa: E402
    Launch,
    backward_launches,
    forward_launch,
    layout_args,
    prepare_inputs,
    row_block,
)
from gr.hstu.kernels.attention.triton.tuning import TileConfig  # noqa: E402
from gr.hstu.kernels.cached_attention import CachedAttentionCall, PagedCache, PageTables  # noqa: E402
from gr.hstu.kernels.cached_attention.triton import KERNEL as CACHED_KERNEL  # noqa: E402
from gr.hstu.kernels.cached_attention.triton import cached_launch, tile_args  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BIAS_PARTS = {  # name -> (position bias, time bucketing or None)
    "none": (False, None),
    "pos": (True, None),
    "time-log": (False, "log"),
    "time-sqrt": (False, "sqrt"),
    "pos+time-log": (True, "log"),
    "pos+time-sqrt": (True, "sqrt"),
}
SWITCHES = ("plain", "targets", "context", "window", "next-event", "per-position-norm")
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@dataclass(frozen=True)
class Case:
    """One launch situation: a path's kernels on a batch with these options."""

    path: str  # "training" (forward, dq, dk/dv) or "serving" (cached attention: forward)
    dtype: str
    bias: str
    switch: str
    dim_qk: int = 64
    dim_v: int = 64
    heads: int = 2
    kernels: Tuple[str, ...] = ()  # only these of the path's kernels (all when empty)

    def label(self) -> str:
        return f"{self.path}/{self.dtype}/{self.bias}/{self.switch}"


@dataclass
class Variant:
    """One compiled kernel and the launches that use it."""

    kernel: str
    dtype: str
    bias: str
    config: str
    dims: str
    used_by: List[str] = field(default_factory=list)
    compile_s: float = 0.0
    registers: int = 0
    spill_bytes: int = 0
    stack_bytes: int = 0
    shared_bytes: int = 0


def case_tensors(case: Case, tokens: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Zero q, k [tokens, H, Dqk] and v [tokens, H, Dv] of ``case``'s heads, dims and dtype."""
    dtype = DTYPES[case.dtype]
    q, k = (torch.zeros(tokens, case.heads, case.dim_qk, dtype=dtype) for _ in range(2))
    return q, k, torch.zeros(tokens, case.heads, case.dim_v, dtype=dtype)


def case_bias(case: Case, times: Tensor, next_event: bool) -> Optional[RelativeBias]:
    """``case``'s bias parts over tokens at ``times`` (queries 30 s later with ``next_event``)."""
    position, bucketing = BIAS_PARTS[case.bias]
    if not position and not bucketing:
        return None
    return RelativeBias(
        position_weights=torch.zeros(201) if position else None,
        time_weights=torch.zeros(128) if bucketing else None,
        timestamps=times if bucketing else None,
        time_bucketing=bucketing or "log",
        query_times=times + 30 if bucketing and next_event else None,
    )


def case_launches(case: Case) -> List[Tuple[Launch, object]]:
    """The kernels ``case`` launches, assembled by the launcher's code on CPU tensors."""
    if case.path == "serving":
        return [(launch, None) for launch in [serving_launch(case)] if not case.kernels or launch.name in case.kernels]
    lengths = [40, 7, 25]
    seq_offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    total = sum(lengths)
    q, k, v = case_tensors(case, total)
    rab = case_bias(case, torch.arange(total) * 60, next_event=case.switch == "next-event")
    targets = torch.tensor([3, 0, 5]) if case.switch == "targets" else None
    call = AttentionCall(
        q,
        k,
        v,
        seq_offsets,
        max(lengths),
        num_targets=targets,
        contextual_len=2 if case.switch == "context" else 0,
        max_attn_len=16 if case.switch == "window" else 0,
        alpha=0.5,
        silu_scale=None if case.switch == "per-position-norm" else 1 / 200,
        rab=rab,
    )
    call.validate()
    inputs = prepare_inputs(call, "triton")
    launches = [forward_launch(q, k, v, inputs, interpreted=False)]
    if case.path == "training":
        launches += list(backward_launches(q, k, v, torch.zeros_like(v), inputs, interpreted=False))
    return [(launch, inputs) for launch in launches if not case.kernels or launch.name in case.kernels]


def serving_launch(case: Case) -> Launch:
    """The cached-attention launch of ``case``: candidates of 3 users (40, 0 and 25 cached tokens in a
    pool of pages of 16), with the case's bias parts and next-event query times."""
    cache_lengths, new_lengths, page_size = [40, 0, 25], [3, 1, 5], 16
    offsets = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])  # noqa: E731
    total, cached = sum(new_lengths), sum(cache_lengths)
    q, k, v = case_tensors(case, total)
    pages = [-(-n // page_size) for n in cache_lengths]
    tables = PageTables(list(torch.arange(sum(pages)).split(pages)), page_size)
    pool_k, pool_v = (x.new_zeros(case.heads, sum(pages) * page_size, x.shape[2]) for x in (k, v))  # as PagePool's
    rab = case_bias(case, torch.arange(total) * 60 + 10**6, next_event=True)
    call = CachedAttentionCall(
        q, k, v, offsets(new_lengths), PagedCache(pool_k, tables), PagedCache(pool_v, tables), offsets(cache_lengths),
        "targets", alpha=0.5, silu_scale=1 / 200, rab=rab, cache_timestamps=torch.arange(cached) * 60,
    )  # fmt: skip
    call.validate()
    return cached_launch(call, interpreted=False)[0]


def compile_variant(launch: Launch, inputs, config: TileConfig, target: GPUTarget, backend):
    """Triton's binder on the launch's full arguments -> (compile key, ASTSource, options)."""
    if launch.name == CACHED_KERNEL:
        kwargs = dict(launch.args, **tile_args(config))
    else:
        _, work = CudaLayout(None).work(launch, inputs, row_block(launch, config))
        kwargs = dict(
            launch.args,
            **work,
            **layout_args(config, False, inputs),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(**kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    source = ASTSource(kernel, signature, constexprs, attrs)
    return source.hash() + str(options), source, options


def resource_usage(cubin: bytes) -> Dict[str, int]:
    """REG, STACK, SHARED and LOCAL of the cubin's kernel, from ``cuobjdump --dump-resource-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [str(TOOLS / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    usage = {name: int(value) for name, value in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out)}
    if "REG" not in usage:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{out}")
    return usage


def timed_compile(source: ASTSource, options, target: GPUTarget) -> Tuple[float, object]:
    start = time.perf_counter()
    compiled = triton.compile(source, target=target, options=options.__dict__)
    return time.perf_counter() - start, compiled


def configs_of(
    kernel: str, dtype: str, dims: Tuple[int, int], major: int, smoke: bool, chosen: Optional[List[TileConfig]] = None
) -> List[TileConfig]:
    """The default tiles of ``kernel`` and the autotuning candidates (``chosen`` instead when given)."""
    if chosen:
        return chosen
    configs = tuning.candidates(major, kernel, dtype, *dims)
    return configs[:1] if smoke else configs


def cases(smoke: bool) -> List[Case]:
    if smoke:  # the smallest training variant, the largest, and the serving kernel
        return [
            Case("training", "fp32", "none", "plain", kernels=("forward",)),
            Case("training", "bf16", "pos+time-log", "targets", kernels=("backward_dkv",)),
            Case("serving", "fp32", "pos+time-log", "targets"),
        ]
    dtypes = ("fp32", "bf16")  # fp16 only where a recipe asks for it
    out = [Case("training", dtype, bias, "plain") for dtype in dtypes for bias in BIAS_PARTS]
    out += [Case("training", dtype, "pos+time-log", switch) for dtype in dtypes for switch in SWITCHES[1:]]
    out += [Case("serving", dtype, bias, "targets") for dtype in dtypes for bias in BIAS_PARTS]
    # head dims that are not a multiple of 16 (no vector loads) or above 64 (the wide tiles)
    out += [
        Case(path, dtype, "pos+time-log", "targets" if path == "serving" else "plain", dim, dim)
        for path in ("training", "serving")
        for dtype in dtypes
        for dim in (50, 128)
    ]
    return out


def recipe_case(path: Path) -> Tuple[Case, str]:
    """The training case of a recipe (its bias parts, head dims, heads, precision), and the
    precision's name."""
    from gr.train.config import load_config

    config = load_config(path)
    hstu = config.model.hstu
    position = hstu.num_position_buckets > 0
    bias = (
        "+".join(part for part, on in (("pos", position), (f"time-{hstu.time_bucketing}", hstu.time_buckets > 0)) if on)
        or "none"
    )
    precision = str(config.trainer.precision)
    dtype = "bf16" if "bf16" in precision else "fp16" if precision.startswith("16") else "fp32"
    switch = "next-event" if hstu.query_time == "next_event" else "plain"
    case = Case("training", dtype, bias, switch, hstu.attention_dim, hstu.linear_dim, hstu.num_heads)
    return case, precision


def compile_all(
    plan: List[Tuple[Case, List[str]]], arch: int, smoke: bool, log, chosen: Optional[List[TileConfig]] = None
) -> Tuple[Dict[str, Variant], Dict[str, List[str]]]:
    """Compile each distinct variant of ``plan`` ((case, groups)) once -> variants by compile key,
    and each group's compile keys."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    major = arch // 10
    variants: Dict[str, Variant] = {}
    groups: Dict[str, List[str]] = {}
    for case, case_groups in plan:
        torch_dtype, dims = str(DTYPES[case.dtype]).removeprefix("torch."), (case.dim_qk, case.dim_v)
        for launch, inputs in case_launches(case):
            for config in configs_of(launch.name, torch_dtype, dims, major, smoke, chosen):
                key, source, options = compile_variant(launch, inputs, config, target, backend)
                for group in case_groups:
                    if group == "all" or config == tuning.default_config(major, launch.name, torch_dtype, *dims):
                        groups.setdefault(group, [])
                        if key not in groups[group]:
                            groups[group].append(key)
                if key in variants:
                    variants[key].used_by.append(case.label())
                    continue
                seconds, compiled = timed_compile(source, options, target)
                usage = resource_usage(compiled.asm["cubin"])
                variant = Variant(
                    kernel=launch.name,
                    dtype=case.dtype,
                    bias=case.bias,
                    config=config.label(),
                    dims=f"{case.dim_qk}/{case.dim_v}",
                    used_by=[case.label()],
                    compile_s=round(seconds, 2),
                    registers=usage["REG"],
                    spill_bytes=usage.get("LOCAL", 0),
                    stack_bytes=usage.get("STACK", 0),
                    shared_bytes=int(compiled.metadata.shared),
                )
                variants[key] = variant
                log(variant)
    return variants, groups


def summary(variants: List[Variant]) -> Dict[str, object]:
    seconds = [v.compile_s for v in variants]
    return dict(
        variants=len(variants),
        max_compile_s=round(max(seconds, default=0.0), 2),
        total_compile_s=round(sum(seconds), 2),
        spills=sum(1 for v in variants if v.spill_bytes or v.stack_bytes),
    )


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, choices=["sm_80", "sm_90"])
    parser.add_argument("--smoke", action="store_true", help="three variants at the default tiles (seconds)")
    parser.add_argument(
        "--recipe",
        type=Path,
        nargs="+",
        default=[],
        help="also report the variants each recipe launches, and their total",
    )
    parser.add_argument("--only-recipe", action="store_true", help="compile the recipes' variants only")
    parser.add_argument("--json", type=Path, help="write every variant's row to this file")
    parser.add_argument(
        "--configs", type=tuning.parse_config, nargs="+", help="compile at these tiles instead (MxN/wW/sS)"
    )
    parser.add_argument("--kernels", nargs="+", choices=tuning.KERNELS, help="only these kernels")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), help="only these dtypes")
    parser.add_argument("--bias", nargs="+", choices=list(BIAS_PARTS), help="only these bias parts")
    args = parser.parse_args(argv)
    if args.only_recipe and not args.recipe:
        parser.error("--only-recipe needs --recipe")
    arch = int(args.arch[3:])
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gr-triton-compile-")  # every compile from scratch

    plan: List[Tuple[Case, List[str]]] = []
    for path in args.recipe:
        case, precision = recipe_case(path)
        print(f"recipe {path}: {case.label()} (precision {precision}), dims {case.dim_qk}/{case.dim_v}")
        group = f"recipe {path}"
        plan.append((case, [group] if args.only_recipe else [group, "all"]))
        plan.append((Case("serving", case.dtype, case.bias, "targets", case.dim_qk, case.dim_v, case.heads), [group]))
    if not args.only_recipe:
        plan += [(case, ["all"]) for case in cases(args.smoke)]
    plan = [
        (replace(case, kernels=tuple(args.kernels or case.kernels)), groups)
        for case, groups in plan
        if (args.dtypes is None or case.dtype in args.dtypes) and (args.bias is None or case.bias in args.bias)
    ]

    print(f"triton {triton.__version__}, target sm_{arch}; load average {'%.2f %.2f %.2f' % os.getloadavg()}")
    header = f"{'kernel':<14} {'dtype':<5} {'bias':<14} {'tiles':<17} {'dims':<6} {'seconds':>7} {'regs':>5} "
    print(header + f"{'spill B':>7} {'stack B':>7} {'shared B':>8}")

    def log(v: Variant) -> None:
        print(
            f"{v.kernel:<14} {v.dtype:<5} {v.bias:<14} {v.config:<17} {v.dims:<6} {v.compile_s:>7.2f} "
            f"{v.registers:>5} {v.spill_bytes:>7} {v.stack_bytes:>7} {v.shared_bytes:>8}",
            flush=True,
        )

    triton.compile(ASTSource(_warm_up, {"X": "*fp32"}), target=GPUTarget("cuda", arch, 32))  # one-off start-up
    variants, groups = compile_all(plan, arch, args.smoke, log, args.configs)
    rows = list(variants.values())
    result = dict(
        bench="triton_compile",
        arch=args.arch,
        triton=triton.__version__,
        launches=sum(len(v.used_by) for v in rows),
        **summary([variants[k] for k in groups.get("all", variants)]),
        max_registers=max(v.registers for v in rows),
        max_shared_bytes=max(v.shared_bytes for v in rows),
        load_average=[round(x, 2) for x in os.getloadavg()],
    )
    if args.recipe:
        result["recipes"] = {}
    for path in args.recipe:
        recipe = summary([variants[k] for k in groups[f"recipe {path}"]])
        result["recipes"][str(path)] = recipe
        print(
            f"recipe {path}: {recipe['variants']} variants at the default tiles, "
            f"{recipe['total_compile_s']} s together, max {recipe['max_compile_s']} s, {recipe['spills']} spilling"
        )
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(v) for v in rows], indent=1) + "\n")
    print(f"load average {'%.2f %.2f %.2f' % os.getloadavg()}")
    print(json.dumps(result))
    return 0


@triton.jit
def _warm_up(X):
    triton.language.store(X, 0.0)


if __name__ == "__main__":
    sys.exit(main())
