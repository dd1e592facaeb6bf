"""The memory and work estimate of a training run (``gr plan`` prints it, ``gr train`` checks it first).

Before training: parameter counts (sparse per table and per rank, dense per module and per
rank), activation memory per sample at the recipe's sequence length for every recompute
mode and precision, FLOPs per token, and whether one rank's share fits in ``--memory-gib``.
The config goes through the trainer's own loader and validation (``gr.train.load_config``);
table rows left to the data are read from it, and the user's PrefixDNN / PostfixDNN are
built on the meta device (no memory) to count their parameters.

Activation model (the HSTU stack on CPU): bytes per token each layer keeps for backward, with
D = hidden_dim, P = heads * (2 linear_dim + 2 attention_dim) (the U/V/Q/K projection) and
A = heads * linear_dim (attention output):

  recompute "none":      x 4D + what ``project`` and ``combine`` keep
  recompute "attention": x 4D + what ``project`` keeps
  recompute "layer":     x 4D

(``gr.hstu.kernels.layer_ops.cost``: each op's bytes in either precision, with and without gr's
native CPU kernels), plus, for the stack, the output 4D, the input-dropout mask (``stack_input``'s
with position embeddings, else the stack's dropout's 4D), and the int64 positions and index
bookkeeping (32); and with the native CPU attention, each layer's saved score tiles, kept with
recompute "none" (a recomputing layer makes them again in backward), and the kernel's cached
layout. The attention's terms are ``gr.hstu.kernels.attention.cost``'s.
Measured against torch's CPU memory profiler in tests/test_plan.py.
In backward, the layer being differentiated holds gradient buffers about the size of its
"none" set, a recomputing layer holds its "none" set again first, and the attention
kernel's backward holds fp32 buffers of 16P - 8A bytes per token (q, k, v and their
gradients, padded and gathered per group) and ~4 score tiles of heads x 128 queries x L
keys: ``peak`` adds those (bench/memory.py compares it with measured peaks).

Memory per rank (``Plan.memory_bytes_per_rank``, what ``gr train``'s pre-check uses on CPU), an upper
bound of a training process's peak resident set: the process before its model (its resident set
when planned, with what training imports loaded: libraries and data) + ``RUNTIME_OVERHEAD_BYTES``
+ the dense parameters, gradients and optimizer state + the tables (``sparse_memory``: the rank's
shards and optimizer state, and what the sparse backend keeps beside them) + the largest
transient: building and sharding the tables, saving or loading a checkpoint, or one batch's
activations, which never overlap. Per table row of stored width D with the optimizer's f floats a
row (one rank, fp32): torch 4 (D + f) resident + 7 D while a checkpoint's weights are checked finite
(8 D while one is loaded, with Adagrad's or Adam's per-weight state) = 11 D + 4 f bytes; torchrec
adds the whole table as built (4 D, and 4 with row-wise Adagrad): 15 D + 4 f (+ 4).
bench/memory.py compares it with training processes' peaks over table sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

# What training imports (Lightning, its loggers, the training module and strategy), loaded before
# plan_for_data measures this process's resident set, as gr.train.run (which imports this module) has them.
import lightning.pytorch.callbacks  # noqa: F401
import lightning.pytorch.loggers  # noqa: F401
import torch
from torch import nn

import gr.train.checkpoint  # noqa: F401
import gr.train.csv_log  # noqa: F401
import gr.train.module  # noqa: F401
import gr.train.npu  # noqa: F401
import gr.train.progress  # noqa: F401
import gr.train.strategy  # noqa: F401
from gr.data.datamodule import SequenceDataModule
from gr.data.features import FeatureSpec
from gr.hstu import HSTUConfig
from gr.hstu.config import RECOMPUTE_MODES
from gr.hstu.kernels.attention import cost as attention_cost
from gr.hstu.kernels.layer_ops import cost as layer_ops_cost
from gr.sparse.row_optimizers import STATE as OPTIMIZER_STATE
from gr.sparse.tables import TableConfig, backend_module, storage_dim
from gr.train.build import build_model
from gr.train.config import TrainConfig
from gr.utils.host import resident_bytes

PRECISION_BYTES = {"32-true": 4, "bf16-mixed": 2, "16-mixed": 2}
FP32 = 4
INT64 = 8
STACK_INDEX_BYTES = 4 * INT64  # token positions (embedding indices) and index bookkeeping
# Optimizer state in floats per parameter for dense optimizers (sparse ones: ``optimizer_state_elements``).
DENSE_OPTIMIZER_FLOATS = {"adamw": 2, "adam": 2, "sgd": 0}
# Bytes per element of a table tensor while a checkpoint is saved: ``gr.utils.finite`` checks each weight with
# torch.isfinite, whose C++ expression (x == x) * (|x| != inf) keeps x == x (1), |x| (4), |x| != inf (1)
# and their product (1) alive to its end.
FINITE_CHECK_BYTES = 7
# ... and loaded: DCP reads each tensor whole, then copies it in, the one read before still referenced.
LOAD_BYTES = 4
# What a Lightning fit adds to the process beyond the tensors modelled here: trainer, loggers, process
# group, the kernels' first-call buffers and what the allocator keeps of freed batches (bench/memory.py
# measured 23-43 MiB over 1e5-4e7 table rows and both backends, 2026-11-27).
RUNTIME_OVERHEAD_BYTES = 96 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class TablePlan:
    """One embedding table: ``params`` = rows x stored dim; ``params_per_rank`` and ``rows_per_rank`` as
    sharded over the ranks (a table-wise table sits whole on one rank, a column-wise one keeps every
    row on each); ``optimizer`` its embedding optimizer, ``optimizer_floats`` that one's state per
    row; ``collection`` the module holding it ("sequence dim<d>" per embedding dim, "common" or "token_bag")."""

    name: str
    rows: int
    dim: int
    sharding: Optional[str]
    params: int
    params_per_rank: Tuple[int, ...]
    optimizer_floats: int
    rows_per_rank: Tuple[int, ...]
    optimizer: str
    collection: str


@dataclass(frozen=True)
class SparseMemory:
    """The tables' bytes on one rank (``sparse_memory``): ``shards`` their weights and optimizer state;
    ``backend`` what the sparse backend keeps beside them; the transients ``build`` (building and
    sharding the tables) and ``checkpoint`` (saving or loading one)."""

    shards: int
    backend: int
    build: int
    checkpoint: int


@dataclass(frozen=True)
class Plan:
    """Everything ``gr plan`` prints. Bytes are per sample (activations) or per rank."""

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
    sparse_backend: str
    sparse_memory_per_rank: Tuple[SparseMemory, ...]
    process_bytes: int  # the process before its model (libraries, data): its resident set when planned, or 0

    @property
    def sparse_params(self) -> int:
        return sum(t.params for t in self.tables)

    @property
    def transient_bytes_per_rank(self) -> Tuple[int, ...]:
        """The largest of what never overlaps: building the tables, a checkpoint, a batch's activations."""
        return tuple(max(m.build, m.checkpoint, self.batch_activation_bytes) for m in self.sparse_memory_per_rank)

    @property
    def memory_bytes_per_rank(self) -> Tuple[int, ...]:
        """Peak resident bytes of each rank's process (see the module docstring)."""
        base = self.process_bytes + RUNTIME_OVERHEAD_BYTES
        return tuple(
            base + state + sparse.backend + transient
            for state, sparse, transient in zip(
                self.state_bytes_per_rank, self.sparse_memory_per_rank, self.transient_bytes_per_rank
            )
        )


def hstu_parameter_count(config: HSTUConfig) -> int:
    """Parameters of the HSTU stack built from ``config``."""
    d, p, a = config.hidden_dim, _projection_width(config), config.num_heads * config.linear_dim
    per_layer = config.num_position_buckets + config.time_buckets + 2 * d + (d * p + p) + 2 * a + (a * d + d)
    positions = (config.max_seq_len + 1) * d if config.position_embedding else 0
    return positions + config.num_layers * per_layer


def hstu_layer_activation_bytes(config: HSTUConfig, recompute: str, compute_bytes: int) -> int:
    """Bytes per token one layer keeps for backward (see the module docstring)."""
    kept = FP32 * config.hidden_dim
    if recompute == "layer":
        return kept
    kept += layer_ops_cost.project_bytes(config.hidden_dim, _projection_width(config), compute_bytes)
    if recompute == "attention":
        return kept
    return kept + layer_ops_cost.combine_bytes(config.num_heads * config.linear_dim, config.dropout, compute_bytes)


def hstu_activation_bytes(config: HSTUConfig, tokens: int, recompute: str, compute_bytes: int) -> Tuple[int, int]:
    """(kept after forward, peak in backward) bytes of the HSTU stack for ``tokens`` tokens."""
    d = config.hidden_dim
    mask_bytes = layer_ops_cost.stack_input_mask_bytes(d) if config.position_embedding else FP32 * d
    stack = FP32 * d + (mask_bytes if config.input_dropout > 0 else 0) + STACK_INDEX_BYTES
    layer = hstu_layer_activation_bytes(config, recompute, compute_bytes)
    tiles = attention_cost.saved_tile_bytes(config.num_heads, tokens, config.max_attn_len)
    kept = tokens * (stack + config.num_layers * layer) + attention_cost.layout_cache_bytes(config.time_buckets, tokens)
    kept += config.num_layers * tiles if recompute == "none" else 0
    full_layer = hstu_layer_activation_bytes(config, "none", compute_bytes)
    recomputed = full_layer - layer
    remade = tiles if recompute != "none" else 0  # the recomputing layer's tiles
    return kept, kept + tokens * (recomputed + full_layer) + remade + attention_backward_bytes(config, tokens)


def attention_backward_bytes(config: HSTUConfig, tokens: int, sequences: int = 1) -> int:
    """Buffers the CPU attention kernel's backward holds for ``sequences`` sequences of ``tokens``
    tokens (``gr.hstu.kernels.attention.cost.backward_bytes``)."""
    return attention_cost.backward_bytes(config.num_heads, config.attention_dim, config.linear_dim, tokens, sequences)


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


def optimizer_state_elements(optimizer: str, rows: int, width: int) -> Tuple[int, ...]:
    """Elements of each state tensor embedding optimizer ``optimizer`` keeps for a [rows, width] shard:
    one value per row or per weight, as FBGEMM's fused kernels and the torch backend's ``RowOptimizer``
    keep them (``gr.sparse.row_optimizers.STATE``)."""
    return tuple(rows if per_row else rows * width for _, per_row in OPTIMIZER_STATE[optimizer])


def sparse_memory(tables: Sequence[TablePlan], backend: str, rank: int) -> SparseMemory:
    """The bytes ``tables`` take on ``rank`` under sparse backend ``backend`` (fp32 throughout).

    Both backends: each shard's weights and optimizer state (``optimizer_state_elements``). Saving a
    checkpoint checks every weight finite (``FINITE_CHECK_BYTES`` per element of the largest shard);
    loading one (``gr train``'s test of its best checkpoint, ``--resume``) reads each tensor whole
    before copying it in (``LOAD_BYTES`` per element of the two largest tensors: weights, optimizer state).
    torchrec: every rank builds every table whole before sharding (``gr.train.build.seeded_model``), and
    ``apply_optimizer_in_backward`` keeps those weights alive all run (its hook on each weight's gradient
    accumulator holds the weight), with its RowWiseAdagrad's row sums ([rows, 1], made through a
    whole-table ``torch.full_like``: a build transient); sharding copies each collection's rows into the
    shards through one ``torch.cat`` of the rank's rows of its tables (the other build transient).
    torch: the tables are the shards, initialised in place; nothing more.
    """
    shards = kept = build = 0
    tensors: List[int] = []  # elements of each tensor of the rank's shards a checkpoint holds
    collections: Dict[str, int] = {}
    for table in tables:
        rows, elements = table.rows_per_rank[rank], table.params_per_rank[rank]
        state = optimizer_state_elements(table.optimizer, rows, elements // rows if rows else 0)
        shards += FP32 * (elements + sum(state))
        tensors += [elements, *state]
        if backend == "torchrec":
            row_sums = table.rows if table.optimizer == "rowwise_adagrad" else 0
            kept += FP32 * (table.params + row_sums)
            build = max(build, FP32 * table.params if row_sums else 0)
            collections[table.collection] = collections.get(table.collection, 0) + FP32 * elements
    largest = sorted(tensors, reverse=True)
    weights = max((t.params_per_rank[rank] for t in tables), default=0)
    checkpoint = max(FINITE_CHECK_BYTES * weights, LOAD_BYTES * sum(largest[:2]))
    return SparseMemory(shards, kept, max([build, *collections.values()]), checkpoint)


def make_plan(
    config: TrainConfig,
    tables: Sequence[TableConfig],
    prefix_dnn: nn.Module,
    postfix_dnn: nn.Module,
    nproc: int,
    process_bytes: int = 0,
) -> Plan:
    """The plan of ``config`` on ``nproc`` ranks; tables with their rows resolved, DNNs built (any
    device); ``process_bytes``: the training process before its model (``resident_bytes``), if known."""
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
    sparse = tuple(sparse_memory(table_plans, config.sparse.backend, rank) for rank in range(nproc))
    state = tuple(dense_state * d + s.shards for d, s in zip(dense_per_rank, sparse))
    compute_bytes = PRECISION_BYTES[config.trainer.precision]
    sequences = rank_batch(config, nproc)
    per_sample = hstu_activation_bytes(hstu, tokens, hstu.recompute, compute_bytes)[1]
    batch = sequences * (per_sample - attention_backward_bytes(hstu, tokens)) + attention_backward_bytes(
        hstu, tokens, sequences
    )
    return Plan(
        nproc=nproc,
        tokens_per_sample=tokens,
        tables=tuple(table_plans),
        dense_params=dense,
        dense_params_per_rank=dense_per_rank,
        activation_bytes=kept,
        activation_peak_bytes=peak,
        forward_flops_per_token=forward,
        training_flops_per_token=training,
        state_bytes_per_rank=state,
        batch_activation_bytes=batch,
        sparse_backend=config.sparse.backend,
        sparse_memory_per_rank=sparse,
        process_bytes=process_bytes,
    )


def dense_state_bytes(config: TrainConfig) -> int:
    """Bytes per dense parameter: fp32 weight, gradient and the optimizer's state."""
    return FP32 * (2 + DENSE_OPTIMIZER_FLOATS[config.optimizer.type])


def rank_batch(config: TrainConfig, nproc: int) -> int:
    """Samples a rank trains per step: its share of the global ``data.batch_size``."""
    return math.ceil(config.data.batch_size / nproc)


def plan_from_config(config: TrainConfig, nproc: int) -> Plan:
    """Read the data for table rows and feature dims, then ``plan_for_data``."""
    data = SequenceDataModule(config.data)
    data.setup()
    return plan_for_data(config, data.feature_spec(), data.tasks, nproc)


def plan_for_data(config: TrainConfig, spec: FeatureSpec, tasks: Sequence[str], nproc: int) -> Plan:
    """The plan of ``config`` on the data ``spec`` describes: the model built on the meta device
    (no memory, however large), then ``make_plan`` with this process's resident set as the process
    before its model, once it holds what training imports (Lightning, its loggers and the training
    module: imported by this module, as by ``gr.train.run``)."""
    backend_module(config.sparse.backend)  # imported outside the meta device: its imports make tensors
    with torch.device("meta"):
        model = build_model(config, spec, tasks)
    tables = list(model.embeddings.tables.values()) if model.embeddings is not None else []
    return make_plan(config, tables, model.prefix_dnn, model.postfix_dnn, nproc, resident_bytes() or 0)


def memory_terms(plan: Plan, config: TrainConfig) -> List[Tuple[int, str]]:
    """[(bytes, the config keys behind them), ...] of the largest rank's ``memory_bytes_per_rank``
    less the process itself, largest first: each table's shards, optimizer state and backend copies
    (the largest table also the transient, when building the tables or a checkpoint is the largest
    one), the HSTU's positional parameters (max_seq_len) and the rest of its layers, the DNNs, and
    the batch's activations (when they are the largest transient)."""
    rank = max(range(plan.nproc), key=lambda r: plan.memory_bytes_per_rank[r])
    hstu = config.model.hstu
    state = dense_state_bytes(config)
    dense_share = plan.dense_params_per_rank[rank] / max(sum(plan.dense_params.values()), 1)
    positional = (hstu.num_layers * hstu.num_position_buckets if hstu.position_buckets is None else 0) + (
        (hstu.max_seq_len + 1) * hstu.hidden_dim if hstu.position_embedding else 0
    )
    transient = plan.transient_bytes_per_rank[rank]
    activations = plan.batch_activation_bytes if transient == plan.batch_activation_bytes else 0
    largest = max(plan.tables, key=lambda t: t.params_per_rank[rank], default=None)
    terms = []
    for t in plan.tables:
        table = sparse_memory([t], plan.sparse_backend, rank)
        terms.append(
            (
                table.shards + table.backend + (transient - activations if t is largest else 0),
                f"model.tables ({t.name}): num_embeddings {t.rows:,} x embedding_dim {t.dim:,}",
            )
        )
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
            activations,
            f"data.batch_size {config.data.batch_size} x {plan.tokens_per_sample} tokens (activations, "
            f"model.hstu.hidden_dim {hstu.hidden_dim:,})",
        ),
    ]
    return sorted(terms, key=lambda term: -term[0])


def check_memory_fits(
    plan: Plan, config: TrainConfig, local_ranks: int, available: Optional[int], resident: Optional[int] = None
) -> None:
    """Refuse a run whose ``local_ranks`` ranks on this machine need more than ``available`` bytes
    (None: unknown, nothing checked) beyond ``resident``, what this process holds already (which
    MemAvailable leaves out; None: its resident set now; the other local ranks' processes are counted
    whole): ValueError naming the estimate, the memory available and the config keys that drive it
    (the terms of ``memory_terms`` above a tenth of the total)."""
    per_rank = max(plan.memory_bytes_per_rank)
    held = (resident_bytes() if resident is None else resident) or 0
    need = per_rank * local_ranks - held
    if available is None or need <= available:
        return
    terms = [(size, keys) for size, keys in memory_terms(plan, config) if size >= per_rank / 10][:3]
    drivers = "; ".join(f"{keys}: {size / GIB:,.1f} GiB" for size, keys in terms)
    raise ValueError(
        f"the run does not fit in memory: gr plan estimates {per_rank * local_ranks / GIB:,.1f} GiB ({local_ranks} "
        f"rank(s) x {per_rank / GIB:,.1f} GiB: the process, weights, gradients, optimizer state, the "
        f"{plan.sparse_backend} backend's table copies and the largest transient), {held / GIB:,.1f} GiB of it "
        f"held by this process already; this machine has {available / GIB:,.1f} GiB available (MemAvailable); "
        f"most of it: {drivers}. Make those smaller, or set trainer.memory_check: false to start anyway"
    )


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
            rows_per_rank = [max(0, min(block, rows - r * block)) for r in range(nproc)]
            per_rank = [r * dim for r in rows_per_rank]
        elif table.sharding == "column_wise":
            columns = _split_sizes(dim, nproc)
            rows_per_rank = [rows if c else 0 for c in columns]
            per_rank = [rows * c for c in columns]
        else:
            rows_per_rank, per_rank = [0] * nproc, [0] * nproc
            rank = load.index(min(load))
            rows_per_rank[rank], per_rank[rank] = rows, rows * dim
        load = [a + b for a, b in zip(load, per_rank)]
        optimizer = (table.optimizer or config.sparse.optimizer).type
        plans.append(
            TablePlan(
                name=table.name,
                rows=rows,
                dim=dim,
                sharding=table.sharding,
                params=rows * dim,
                params_per_rank=tuple(per_rank),
                optimizer_floats=sum(optimizer_state_elements(optimizer, 1, dim)),
                rows_per_rank=tuple(rows_per_rank),
                optimizer=optimizer,
                collection=f"sequence dim{table.embedding_dim}" if table.kind == "sequence" else table.kind,
            )
        )
    return sorted(plans, key=lambda t: t.name)


def _fsdp_shards(config: HSTUConfig, nproc: int) -> List[int]:
    """Parameters of the HSTU stack per rank under FSDP2: every parameter chunked along dim 0."""
    d, p, a = config.hidden_dim, _projection_width(config), config.num_heads * config.linear_dim
    shapes: List[Tuple[int, ...]] = [(config.max_seq_len + 1, d)] if config.position_embedding else []
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
