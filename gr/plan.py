"""``python -m gr.plan --config X.yaml --nproc N [--memory-gib G] [--section.key value ...]``.

Before training: parameter counts (sparse per table and per rank, dense per module and per
rank), activation memory per sample at the recipe's sequence length for every recompute
mode and precision, FLOPs per token, and whether one rank's share fits in ``--memory-gib``.
The config goes through the trainer's own loader and validation (``gr.train.load_config``);
table rows left to the data are read from it, and the user's PrefixDNN / PostfixDNN are
built on the meta device (no memory) to count their parameters.

Activation model (the HSTU stack, CPU attention kernel, which keeps q, k, v and no L x L
scores): bytes per token each layer keeps for backward, with ``e`` the compute dtype's
bytes (4 fp32, 2 under bf16 autocast), D = hidden_dim, P = heads * (2 linear_dim + 2
attention_dim) (the U/V/Q/K projection), A = heads * linear_dim (attention output):

  recompute "none":      x 4D + LayerNorm stats 8 + LN(x) eD + pre-SiLU eP + SiLU eP
                         (the kernel keeps q, k, v as views of it, bf16 included)
                         + attention eA + stats 8 + LN(attention) eA
                         + dropout mask eA and output eA (or the product eA without dropout)
                         (with gr's native CPU kernels, ``gr.hstu.layer_ops``, e = 4 in either
                         precision (bf16 autocast runs them in bf16 math on fp32 activations): no
                         LN(x) and no output input, which backward recomputes; after the attention
                         4A + stats 8 + dropout mask A)
  recompute "attention": x 4D + stats 8 + LN(x) eD + pre-SiLU eP + SiLU eP
  recompute "layer":     x 4D

plus, for the stack, the output 4D, the input-dropout mask 4D (a byte mask D with the native CPU
kernels' fused stack input, ``gr.hstu.layer_ops.stack_input``), and the int64 positions and
index bookkeeping (32); and with the native CPU attention, each layer's fp32 weights and SiLU'
per score element of its 32-query blocks (``saved_tile_bytes``, at most ``SAVED_TILE_FLOATS`` a
batch), kept with recompute "none" (a recomputing layer makes them again in backward).
Measured against torch's CPU memory profiler in tests/test_plan.py.
In backward, the layer being differentiated holds gradient buffers about the size of its
"none" set, a recomputing layer holds its "none" set again first, and the attention
kernel's backward holds fp32 buffers of 16P - 8A bytes per token (q, k, v and their
gradients, padded and gathered per group) and ~4 score tiles of heads x 128 queries x L
keys: ``peak`` adds those (bench/memory.py compares it with measured peaks).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from gr.data.features import FeatureSpec
from gr.hstu import HSTUConfig
from gr.hstu.config import RECOMPUTE_MODES
from gr.hstu.kernels.cpu import (
    LAYOUT_CACHE_ELEMENTS,
    QUERY_CHUNK,
    ROW_BLOCK,
    SAVED_TILE_FLOATS,
    TILE_ELEMENTS,
    padded_lengths,
)
from gr.native import fused_expected
from gr.sparse.tables import TableConfig, backend_module, storage_dim
from gr.train.config import TrainConfig, load_config

PRECISION_BYTES = {"32-true": 4, "bf16-mixed": 2, "16-mixed": 2}
FP32 = 4
INT64 = 8
INT32 = 4
LAYER_NORM_STATS = 2 * FP32  # mean and 1/std per token
STACK_INDEX_BYTES = 4 * INT64  # token positions (embedding indices) and index bookkeeping
SCORE_TILES = 4  # score-sized fp32 buffers alive at once in the attention backward (scores, SiLU, gradients)
# Optimizer state in floats: per parameter for dense optimizers, per table row (of `dim`) for sparse.
DENSE_OPTIMIZER_FLOATS = {"adamw": 2, "adam": 2, "sgd": 0}
SPARSE_OPTIMIZER_FLOATS = {
    "sgd": lambda dim: 0,
    "adagrad": lambda dim: dim,
    "rowwise_adagrad": lambda dim: 1,
    "adam": lambda dim: 2 * dim,
    "partial_rowwise_adam": lambda dim: dim + 1,
}
GIB = 1 << 30
MEMINFO = "/proc/meminfo"


@dataclass(frozen=True)
class TablePlan:
    """One embedding table: ``params`` = rows x stored dim; ``rows_per_rank`` as sharded over the ranks
    (a table-wise table sits whole on one rank)."""

    name: str
    rows: int
    dim: int
    sharding: str
    params: int
    params_per_rank: Tuple[int, ...]
    optimizer_floats: int


@dataclass(frozen=True)
class Plan:
    """Everything ``python -m gr.plan`` prints. Bytes are per sample (activations) or per rank."""

    nproc: int
    tokens_per_sample: int
    tables: Tuple[TablePlan, ...]
    dense_params: Dict[str, int]  # module -> parameters
    dense_params_per_rank: Tuple[int, ...]
    activation_bytes: Dict[str, Dict[str, int]]  # precision -> recompute -> kept after forward
    activation_peak_bytes: Dict[str, Dict[str, int]]  # precision -> recompute -> peak in backward
    forward_flops_per_token: Dict[str, int]  # "hstu", "dnn"
    training_flops_per_token: int
    state_bytes_per_rank: Tuple[int, ...]  # parameters, gradients, optimizer state
    batch_activation_bytes: int  # per rank: peak for its share of the global batch (recompute, precision)

    @property
    def sparse_params(self) -> int:
        return sum(t.params for t in self.tables)

    @property
    def memory_bytes_per_rank(self) -> Tuple[int, ...]:
        return tuple(s + self.batch_activation_bytes for s in self.state_bytes_per_rank)


def hstu_parameter_count(config: HSTUConfig) -> int:
    """Parameters of the HSTU stack built from ``config``."""
    d, p, a = config.hidden_dim, _projection_width(config), config.num_heads * config.linear_dim
    per_layer = config.num_position_buckets + config.time_buckets + 2 * d + (d * p + p) + 2 * a + (a * d + d)
    positions = (config.max_seq_len + 1) * d if config.position_embedding else 0
    return positions + config.num_layers * per_layer


def hstu_layer_activation_bytes(config: HSTUConfig, recompute: str, compute_bytes: int) -> int:
    """Bytes per token one layer keeps for backward (see the module docstring)."""
    d, p, a = config.hidden_dim, _projection_width(config), config.num_heads * config.linear_dim
    if recompute == "layer":
        return FP32 * d
    fused = fused_expected()  # gr.hstu.layer_ops: fp32 in either precision; backward recomputes LN(x)
    e = FP32 if fused else compute_bytes
    kept = FP32 * d + LAYER_NORM_STATS + (0 if fused else e * d) + 2 * e * p
    if recompute == "attention":
        return kept
    if fused:  # fp32 attention rows and a byte mask; backward recomputes the output's input
        after_attention = FP32 * a + (a if config.dropout > 0 else 0)
    else:
        after_attention = (4 if config.dropout > 0 else 3) * e * a
    return kept + LAYER_NORM_STATS + after_attention


def hstu_activation_bytes(config: HSTUConfig, tokens: int, recompute: str, compute_bytes: int) -> Tuple[int, int]:
    """(kept after forward, peak in backward) bytes of the HSTU stack for ``tokens`` tokens."""
    d = config.hidden_dim
    byte_mask = fused_expected() and config.position_embedding  # gr.hstu.layer_ops.stack_input
    mask = (d if byte_mask else FP32 * d) if config.input_dropout > 0 else 0
    stack = FP32 * d + mask + STACK_INDEX_BYTES
    layer = hstu_layer_activation_bytes(config, recompute, compute_bytes)
    tiles = saved_tile_bytes(config, tokens)
    kept = tokens * (stack + config.num_layers * layer) + layout_cache_bytes(config, tokens)
    kept += config.num_layers * tiles if recompute == "none" else 0
    full_layer = hstu_layer_activation_bytes(config, "none", compute_bytes)
    recomputed = full_layer - layer
    remade = tiles if recompute != "none" else 0  # the recomputing layer's tiles
    return kept, kept + tokens * (recomputed + full_layer) + remade + attention_backward_bytes(config, tokens)


def attention_backward_bytes(config: HSTUConfig, tokens: int, sequences: int = 1) -> int:
    """Buffers the CPU attention kernel's backward holds for ``sequences`` sequences of ``tokens``
    tokens (a tile batches sequences of one length up to ``TILE_ELEMENTS`` scores)."""
    p, a = _projection_width(config), config.num_heads * config.linear_dim
    tile = min(TILE_ELEMENTS, sequences * config.num_heads * min(QUERY_CHUNK, tokens) * tokens)
    return sequences * tokens * FP32 * (4 * p - 2 * a) + SCORE_TILES * FP32 * tile


def saved_tile_bytes(config: HSTUConfig, tokens: int) -> int:
    """The native CPU attention's tiles of one layer for one sequence of ``tokens`` tokens, kept
    from forward to backward: fp32 weights and SiLU' per head for the keys each block of
    ``ROW_BLOCK`` query rows sees (the chunks of ``gr.hstu.kernels.cpu``; at most
    ``SAVED_TILE_FLOATS`` floats a batch, else none are kept)."""
    if not fused_expected() or tokens == 0 or 2 * config.num_heads * tokens > SAVED_TILE_FLOATS:
        return 0  # (the last: every row sees at least itself, so the tiles are too big to keep)
    padded = int(padded_lengths(torch.tensor([tokens]))[0])
    rows, window, elements = min(padded, QUERY_CHUNK), config.max_attn_len, 0
    for m0 in range(0, padded, rows):
        lo = max(m0 - window, 0) if window > 0 else 0
        keys = max(0, min(m0 + rows, tokens) - lo)
        for r0 in range(m0, min(m0 + rows, tokens), ROW_BLOCK):
            r1 = min(r0 + ROW_BLOCK, m0 + rows, tokens)
            elements += (r1 - r0) * min(r1 - lo, keys)
    floats = 2 * config.num_heads * elements
    return FP32 * floats if floats <= SAVED_TILE_FLOATS else 0


def layout_cache_bytes(config: HSTUConfig, tokens: int) -> int:
    """The CPU kernel's cached layout of one sequence of ``tokens`` tokens, kept from forward to
    backward: a time-bias bucket per (query, key) of each query chunk's padded keys (at most
    ``LAYOUT_CACHE_ELEMENTS`` a batch; for the fused tiles one byte up to 256 buckets, else int32;
    int64 unfused); position buckets and masks are shared by a group."""
    if config.time_buckets == 0 or tokens == 0:
        return 0
    padded = int(padded_lengths(torch.tensor([tokens]))[0])
    bucket_bytes = (1 if config.time_buckets <= 256 else INT32) if fused_expected() else INT64
    if padded >= LAYOUT_CACHE_ELEMENTS:  # every query sees at least one key: the cap is reached
        return bucket_bytes * LAYOUT_CACHE_ELEMENTS
    chunks = range(0, padded, QUERY_CHUNK)
    elements = sum((min(m0 + QUERY_CHUNK, padded) - m0) * min(m0 + QUERY_CHUNK, padded) for m0 in chunks)
    return bucket_bytes * min(LAYOUT_CACHE_ELEMENTS, elements)


def hstu_forward_flops_per_token(config: HSTUConfig, seq_len: int) -> int:
    """Multiply-adds x 2 per token: projections, and attention over the keys a token sees on
    average in a causal sequence of ``seq_len`` (bounded by ``max_attn_len``)."""
    d, p, a = config.hidden_dim, _projection_width(config), config.num_heads * config.linear_dim
    keys = (seq_len + 1) / 2
    if config.max_attn_len:
        keys = min(keys, config.max_attn_len + 1)
    attention = 2 * config.num_heads * (config.attention_dim + config.linear_dim) * keys
    return int(config.num_layers * (2 * d * p + 2 * a * d + attention))


def linear_flops(module: nn.Module) -> int:
    """2 x the weights of every nn.Linear in ``module``: its forward FLOPs per row."""
    return sum(2 * m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def make_plan(
    config: TrainConfig, tables: Sequence[TableConfig], prefix_dnn: nn.Module, postfix_dnn: nn.Module, nproc: int
) -> Plan:
    """The plan of ``config`` on ``nproc`` ranks; tables with their rows resolved, DNNs built (any device)."""
    if nproc < 1:
        raise ValueError(f"--nproc: expected an int >= 1, got {nproc}")
    hstu = config.model.hstu
    tokens = config.data.max_seq_len
    if config.task_type == "ranking":
        tokens += config.data.ranking.positives_per_sample + config.data.ranking.num_negatives
    table_plans = _table_plans(config, tables, nproc)
    dense = {"prefix_dnn": _count(prefix_dnn), "hstu": hstu_parameter_count(hstu), "postfix_dnn": _count(postfix_dnn)}
    replicated = dense["prefix_dnn"] + dense["postfix_dnn"]
    if config.distributed.dense_sharding == "fsdp2":
        dense_per_rank = tuple(replicated + s for s in _fsdp_shards(hstu, nproc))
    else:
        dense_per_rank = (replicated + dense["hstu"],) * nproc
    kept: Dict[str, Dict[str, int]] = {}
    peak: Dict[str, Dict[str, int]] = {}
    for precision in ("32-true", "bf16-mixed"):
        kept[precision], peak[precision] = {}, {}
        for mode in RECOMPUTE_MODES:
            kept[precision][mode], peak[precision][mode] = hstu_activation_bytes(
                hstu, tokens, mode, PRECISION_BYTES[precision]
            )
    forward = {
        "hstu": hstu_forward_flops_per_token(hstu, tokens),
        "dnn": linear_flops(prefix_dnn) + linear_flops(postfix_dnn),
    }
    training = 3 * sum(forward.values()) + _recomputed_flops(hstu, tokens)
    dense_state = dense_state_bytes(config)
    sparse_per_rank = [0] * nproc
    for table in table_plans:
        for rank, params in enumerate(table.params_per_rank):
            rows = params // table.dim
            sparse_per_rank[rank] += FP32 * (params + rows * table.optimizer_floats)
    state = tuple(dense_state * d + s for d, s in zip(dense_per_rank, sparse_per_rank))
    compute_bytes = PRECISION_BYTES[config.trainer.precision]
    sequences = rank_batch(config, nproc)
    per_sample = hstu_activation_bytes(hstu, tokens, hstu.recompute, compute_bytes)[1]
    batch = sequences * (per_sample - attention_backward_bytes(hstu, tokens)) + attention_backward_bytes(
        hstu, tokens, sequences
    )
    return Plan(nproc, tokens, tuple(table_plans), dense, dense_per_rank, kept, peak, forward, training, state, batch)


def dense_state_bytes(config: TrainConfig) -> int:
    """Bytes per dense parameter: fp32 weight, gradient and the optimizer's state."""
    return FP32 * (2 + DENSE_OPTIMIZER_FLOATS[config.optimizer.type])


def rank_batch(config: TrainConfig, nproc: int) -> int:
    """Samples a rank trains per step: its share of the global ``data.batch_size``."""
    return math.ceil(config.data.batch_size / nproc)


def plan_from_config(config: TrainConfig, nproc: int) -> Plan:
    """Read the data for table rows and feature dims, then ``plan_for_data``."""
    from gr.data.datamodule import SequenceDataModule

    data = SequenceDataModule(config.data)
    data.setup()
    return plan_for_data(config, data.feature_spec(), data.tasks, nproc)


def plan_for_data(config: TrainConfig, spec: FeatureSpec, tasks: Sequence[str], nproc: int) -> Plan:
    """The plan of ``config`` on the data ``spec`` describes: the model built on the meta device
    (no memory, however large), then ``make_plan``."""
    from gr.train.build import build_model

    backend_module(config.sparse.backend)  # imported outside the meta device: its imports make tensors
    with torch.device("meta"):
        model = build_model(config, spec, tasks)
    tables = list(model.embeddings.tables.values()) if model.embeddings is not None else []
    return make_plan(config, tables, model.prefix_dnn, model.postfix_dnn, nproc)


def available_memory_bytes(meminfo: str = MEMINFO) -> Optional[int]:
    """What this machine can give a new process without swapping: ``MemAvailable`` of
    /proc/meminfo (Linux), or None where it cannot be read."""
    try:
        with open(meminfo, encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def memory_terms(plan: Plan, config: TrainConfig) -> List[Tuple[int, str]]:
    """[(bytes, the config keys behind them), ...] of the largest rank's ``memory_bytes_per_rank``,
    largest first: each table's rows and optimizer state, the HSTU's positional parameters
    (max_seq_len) and the rest of its layers, the DNNs, and the batch's activations."""
    rank = max(range(plan.nproc), key=lambda r: plan.memory_bytes_per_rank[r])
    hstu = config.model.hstu
    state = dense_state_bytes(config)
    dense_share = plan.dense_params_per_rank[rank] / max(sum(plan.dense_params.values()), 1)
    positional = (hstu.num_layers * hstu.num_position_buckets if hstu.position_buckets is None else 0) + (
        (hstu.max_seq_len + 1) * hstu.hidden_dim if hstu.position_embedding else 0
    )
    terms = [
        (
            FP32 * (t.params_per_rank[rank] + t.params_per_rank[rank] // t.dim * t.optimizer_floats),
            f"model.tables ({t.name}): num_embeddings {t.rows:,} x embedding_dim {t.dim:,}",
        )
        for t in plan.tables
    ]
    terms += [
        (int(state * positional * dense_share), f"model.hstu.max_seq_len {hstu.max_seq_len:,} (positions)"),
        (
            int(state * (plan.dense_params["hstu"] - positional) * dense_share),
            f"model.hstu.hidden_dim {hstu.hidden_dim:,} x num_layers {hstu.num_layers} (HSTU layers)",
        ),
        (
            state * (plan.dense_params["prefix_dnn"] + plan.dense_params["postfix_dnn"]),
            "model.prefix_dnn / model.postfix_dnn",
        ),
        (
            plan.batch_activation_bytes,
            f"data.batch_size {config.data.batch_size} x {plan.tokens_per_sample} tokens (activations, "
            f"model.hstu.hidden_dim {hstu.hidden_dim:,})",
        ),
    ]
    return sorted(terms, key=lambda term: -term[0])


def check_memory_fits(plan: Plan, config: TrainConfig, local_ranks: int, available: Optional[int]) -> None:
    """Refuse a run whose ``local_ranks`` ranks on this machine need more than ``available`` bytes
    (None: unknown, nothing checked): ValueError naming the estimate, the memory available and
    the config keys that drive it (the terms of ``memory_terms`` above a tenth of the total)."""
    per_rank = max(plan.memory_bytes_per_rank)
    need = per_rank * local_ranks
    if available is None or need <= available:
        return
    terms = [(size, keys) for size, keys in memory_terms(plan, config) if size >= per_rank / 10][:3]
    drivers = "; ".join(f"{keys}: {size / GIB:,.1f} GiB" for size, keys in terms)
    raise ValueError(
        f"the run does not fit in memory: gr plan estimates {need / GIB:,.1f} GiB ({local_ranks} rank(s) x "
        f"{per_rank / GIB:,.1f} GiB: weights, gradients, optimizer state and batch activations), this machine has "
        f"{available / GIB:,.1f} GiB available (MemAvailable); most of it: {drivers}. Make those smaller, or set "
        "trainer.memory_check: false to start anyway"
    )


def format_plan(plan: Plan, config: TrainConfig, memory_gib: Optional[float]) -> str:
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
    lines.append(
        f"memory per rank (weights, gradients, optimizer state + batch activations at "
        f"{config.trainer.precision}, recompute {config.model.hstu.recompute!r}): {need / GIB:.3f} GiB"
    )
    if memory_gib is not None:
        verdict = "fits" if need <= memory_gib * GIB else "does NOT fit"
        lines.append(f"{verdict} in {memory_gib} GiB per rank")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from gr.train.cli import parse_overrides

    parser = argparse.ArgumentParser(prog="python -m gr.plan", description=__doc__.split("\n\n")[1])
    parser.add_argument("--config", required=True, help="recipe YAML (as for train.py)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks to shard over (default 1)")
    parser.add_argument("--memory-gib", type=float, help="memory per rank to check the plan against")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    try:
        config = load_config(args.config, parse_overrides(parser, rest))
        plan = plan_from_config(config, args.nproc)
    except (ValueError, FileNotFoundError) as error:
        print(f"gr.plan: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(plan), "memory_bytes_per_rank": plan.memory_bytes_per_rank}))
    else:
        print(format_plan(plan, config, args.memory_gib))
    return 0


def _projection_width(config: HSTUConfig) -> int:
    return config.num_heads * (2 * config.linear_dim + 2 * config.attention_dim)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _table_plans(config: TrainConfig, tables: Sequence[TableConfig], nproc: int) -> List[TablePlan]:
    """Row-wise: TorchRec's blocks of ceil(rows / nproc) rows; column-wise: columns split evenly;
    table-wise: whole tables, largest first onto the least loaded rank (the planner may differ)."""
    plans, load = [], [0] * nproc
    for table in sorted(tables, key=lambda t: -t.num_embeddings * storage_dim(t.embedding_dim)):
        rows, dim = table.num_embeddings, storage_dim(table.embedding_dim)
        if table.sharding in ("row_wise", "table_row_wise"):
            block = -(-rows // nproc)
            per_rank = [max(0, min(block, rows - r * block)) * dim for r in range(nproc)]
        elif table.sharding == "column_wise":
            per_rank = [rows * columns for columns in _split_sizes(dim, nproc)]
        else:
            per_rank = [0] * nproc
            per_rank[load.index(min(load))] = rows * dim
        load = [a + b for a, b in zip(load, per_rank)]
        optimizer = (table.optimizer or config.sparse.optimizer).type
        plans.append(
            TablePlan(
                table.name,
                rows,
                dim,
                table.sharding,
                rows * dim,
                tuple(per_rank),
                SPARSE_OPTIMIZER_FLOATS[optimizer](dim),
            )
        )
    return sorted(plans, key=lambda t: t.name)


def _fsdp_shards(config: HSTUConfig, nproc: int) -> List[int]:
    """Parameters of the HSTU stack per rank under FSDP2: every parameter chunked along dim 0."""
    d, p, a = config.hidden_dim, _projection_width(config), config.num_heads * config.linear_dim
    shapes = [(config.max_seq_len + 1, d)] if config.position_embedding else []
    layer = [(config.num_position_buckets,), (config.time_buckets,), (d,), (d,), (p, d), (p,), (a,), (a,), (d, a), (d,)]
    shapes += layer * config.num_layers
    per_rank = [0] * nproc
    for shape in shapes:
        if shape[0] == 0:
            continue
        width = math.prod(shape[1:])
        for rank, rows in enumerate(_chunk_sizes(shape[0], nproc)):
            per_rank[rank] += rows * width
    return per_rank


def _chunk_sizes(n: int, parts: int) -> List[int]:
    """Lengths of ``torch.arange(n).chunk(parts)``, padded with zeros to ``parts`` (no tensor made)."""
    size = -(-n // parts)
    return [max(0, min(size, n - i * size)) for i in range(parts)]


def _split_sizes(n: int, parts: int) -> List[int]:
    """Lengths of ``torch.arange(n).tensor_split(parts)`` (no tensor made)."""
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def _recomputed_flops(config: HSTUConfig, seq_len: int) -> int:
    full = hstu_forward_flops_per_token(config, seq_len)
    if config.recompute == "layer":
        return full
    if config.recompute == "attention":
        d, p = config.hidden_dim, _projection_width(config)
        return full - config.num_layers * 2 * d * p
    return 0


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


if __name__ == "__main__":
    sys.exit(main())
