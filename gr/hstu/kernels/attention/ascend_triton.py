"""The HSTU attention kernels laid out for triton-ascend's NPU constraints.

The same kernels and launcher as the CUDA variant (``triton.blocks``, ``triton.host``), with
the layout triton-ascend's programming guide asks for on Ascend NPUs:

* a fixed grid of one program per AI (cube) core, each looping over a work list instead of
  one program per tile (extra programs beyond the physical cores run in further rounds and
  pay start-up each time). The list holds only real blocks of the jagged batch (no empty
  programs for short sequences), costliest first so the cores finish together;
* bias weights and time-bucket thresholds preloaded once per program into on-chip memory
  and read with ``tl.gather`` (no scattered global loads); position weights as one
  contiguous window per tile;
* block sizes multiples of 16, int32 index math, fp32 ``tl.atomic_add`` only (for the bias
  gradient: A2/A3 have no int64/fp64 atomics), no atomics for q/k/v gradients.

On CPU tensors it runs under ``TRITON_INTERPRET=1`` with PyPI triton (tests); on an NPU host it
needs triton-ascend in place of triton.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import triton
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from gr.hstu.kernels.attention.common import AttentionCall
from gr.hstu.kernels.attention.triton.blocks import attention_kernel
from gr.hstu.kernels.attention.triton.host import KernelInputs, Launch, TritonKernels, apply_kernels, prepare_inputs
from gr.hstu.kernels.attention.triton.tuning import TileConfig
from gr.jagged import lengths_from_offsets

NPU_BLOCKS = (64, 64)  # (BLOCK_M, BLOCK_N) on an NPU
INTERPRETER_BLOCKS = (64, 64)
INTERPRETER_CORES = 3  # programs of the persistent grid when interpreted on CPU


def ascend_triton_hstu_attention(
    call: AttentionCall, *, blocks: Optional[Tuple[int, int]] = None, num_cores: Optional[int] = None
) -> Tensor:
    """See ``gr.hstu.kernels.attention.hstu_attention``; returns [T, H, Dv].

    blocks: (BLOCK_M, BLOCK_N), multiples of 16; num_cores: programs of the persistent grid
    (None: the device's AI core count, or ``INTERPRETER_CORES`` under the interpreter).
    """
    interpreted = isinstance(attention_kernel, InterpretedFunction)
    if call.q.device.type != "npu" and not interpreted:
        raise RuntimeError(
            f"hstu_attention[ascend_triton]: tensors are on {call.q.device.type}; the kernels need an NPU with "
            "triton-ascend, or TRITON_INTERPRET=1 set before gr.hstu.kernels.attention.ascend_triton is imported "
            "(CPU, tests)"
        )
    blocks = blocks or (INTERPRETER_BLOCKS if interpreted else NPU_BLOCKS)
    if any(b % 16 or b <= 0 for b in blocks):
        raise ValueError(f"hstu_attention[ascend_triton]: blocks must be positive multiples of 16, got {blocks}")
    if num_cores is None:
        num_cores = INTERPRETER_CORES if interpreted else _ai_cores(call.q.device)
    inputs = prepare_inputs(call, "ascend_triton")
    return apply_kernels(call, inputs, TritonKernels(AscendLayout(blocks, num_cores), interpreted))


def _ai_cores(device: torch.device) -> int:
    """Cube cores of the NPU (the grid size triton-ascend recommends for tl.dot kernels)."""
    properties = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    return int(properties["num_aicore"])


def work_list(seq_offsets: Tensor, block: int, query_major: bool) -> Tuple[Tensor, Tensor]:
    """Blocks of the jagged batch, costliest first.

    returns (sequence, first row) of each block, both [W] int32. A query block's cost grows
    with its start (more keys before it), a key block's with the rows after it.
    """
    lengths = lengths_from_offsets(seq_offsets.long())
    counts = (lengths + block - 1) // block
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), counts)
    first_block = torch.cumsum(counts, 0) - counts
    start = (torch.arange(seq.numel(), device=lengths.device) - first_block[seq]) * block
    cost = start if query_major else lengths[seq] - start
    order = torch.argsort(cost, descending=True, stable=True)
    return seq[order].int(), start[order].int()


class AscendLayout:
    """A persistent grid of ``num_cores`` programs over the work list; fixed tile sizes."""

    ub_tables = True

    def __init__(self, blocks: Tuple[int, int], num_cores: int) -> None:
        self.blocks, self.num_cores = blocks, num_cores

    def config(self, launch: Launch, inputs: KernelInputs, run: Callable[[TileConfig], None]) -> TileConfig:
        return TileConfig(*self.blocks)

    def work(self, launch: Launch, inputs: KernelInputs, block: int) -> Tuple[Tuple[int, ...], dict]:
        seq, start = work_list(inputs.seq_offsets, block, query_major=launch.row_block == "BLOCK_M")
        work = dict(TileSeq=seq, TileStart=start, num_work=seq.numel() * launch.args["H"], WORK_LIST=True)
        return (self.num_cores,), work
