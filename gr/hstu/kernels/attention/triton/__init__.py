"""The ``triton`` attention backend: one fused Triton kernel for the forward, dq and dk/dv passes.

* ``cuda``: the backend's entry (``triton_hstu_attention``) and the CUDA layout (grid, tiles);
* ``host``: argument checks, the inputs laid out for the kernels, the launcher and the autograd
  wrapper, shared with ``gr.hstu.kernels.attention.ascend_triton``;
* ``blocks``: the device code;
* ``tuning``: the tile tables per architecture and the autotune cache (no triton import).

Nothing is imported here, so ``tuning`` loads without triton.
"""
