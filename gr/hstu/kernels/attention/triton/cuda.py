"""Fused jagged HSTU attention in Triton for CUDA (forward, backward, bias-weight gradients).

One program per (query or key block, sequence, head) over the jagged tensors (no padding;
blocks past a sequence's end return at once). The kernels (``blocks``) skip what the
mask hides, so a sequence with L history and N target tokens costs O(L^2 + N*L). Backward: dq
in a query-major pass (no atomics), dk/dv in a key-major pass that also adds dS into the
position/time bucket gradients with fp32 atomics. Tile sizes come from ``tuning``: the
architecture's table, or autotuned once per key and kept on disk.

On CPU tensors it runs under ``TRITON_INTERPRET=1`` (set before this module is imported).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import triton
import triton.testing
from torch import Tensor

from gr.hstu.kernels.attention.common import AttentionCall
from gr.hstu.kernels.attention.triton import tuning
from gr.hstu.kernels.attention.triton.blocks import attention_kernel
from gr.hstu.kernels.attention.triton.host import (
    KernelInputs,
    Launch,
    TritonKernels,
    apply_kernels,
    interpreted_on,
    prepare_inputs,
)
from gr.hstu.kernels.attention.triton.tuning import TileConfig, TuningKey

INTERPRETER_BLOCKS = (64, 64)  # (BLOCK_M, BLOCK_N) when interpreted on CPU
_CHOSEN: Dict[TuningKey, TileConfig] = {}  # this process's configurations, by key


def triton_hstu_attention(call: AttentionCall, *, blocks: Optional[Tuple[int, int]] = None) -> Tensor:
    """See ``gr.hstu.kernels.attention.hstu_attention``; returns [T, H, Dv].

    blocks: (BLOCK_M, BLOCK_N), multiples of 16; None: ``tuning``'s choice on CUDA,
    ``INTERPRETER_BLOCKS`` under the interpreter.
    """
    interpreted = interpreted_on(call.q.device, "hstu_attention[triton]", attention_kernel)
    if blocks is not None and any(b % 16 or b <= 0 for b in blocks):
        raise ValueError(f"hstu_attention[triton]: blocks must be positive multiples of 16, got {blocks}")
    inputs = prepare_inputs(call, "triton")
    if blocks is None and interpreted:
        blocks = INTERPRETER_BLOCKS
    return apply_kernels(call, inputs, TritonKernels(CudaLayout(blocks), interpreted))


class CudaLayout:
    """One program per (sequence and head, block along the longest sequence); tile sizes fixed,
    from the architecture's table, or autotuned (``tuning``)."""

    ub_tables = False

    def __init__(self, blocks: Optional[Tuple[int, int]]) -> None:
        self.blocks = blocks

    def config(self, launch: Launch, inputs: KernelInputs, run: Callable[[TileConfig], None]) -> TileConfig:
        if self.blocks is not None:
            return TileConfig(*self.blocks)
        q, v = launch.args["Q"], launch.args["V"]
        major = torch.cuda.get_device_capability(q.device)[0]
        dtype = str(q.dtype).removeprefix("torch.")
        if not tuning.autotune_enabled():
            return tuning.default_config(major, launch.name, dtype, q.shape[2], v.shape[2])
        key = TuningKey(
            gpu=torch.cuda.get_device_name(q.device),
            triton=triton.__version__,
            kernel=launch.name,
            max_len=tuning.length_bucket(inputs.max_seq_len),
            dim_qk=q.shape[2],
            dim_v=v.shape[2],
            dtype=dtype,
        )
        if key not in _CHOSEN:
            candidates = tuning.candidates(major, launch.name, dtype, q.shape[2], v.shape[2])
            time_ms = lambda config: triton.testing.do_bench(lambda: run(config), warmup=5, rep=20)  # noqa: E731
            _CHOSEN[key] = tuning.tune(key, candidates, time_ms, tuning.TuningCache(tuning.cache_dir()))
        return _CHOSEN[key]

    def work(self, launch: Launch, inputs: KernelInputs, block: int) -> Tuple[Tuple[int, ...], dict]:
        """Grid (B * H, blocks along the longest sequence): B * H first, CUDA's axis 0 has no 65535 limit."""
        programs = inputs.batch * launch.args["H"]
        grid = (programs, triton.cdiv(inputs.max_seq_len, block))
        return grid, dict(TileSeq=inputs.seq_offsets, TileStart=inputs.seq_offsets, num_work=programs, WORK_LIST=False)
