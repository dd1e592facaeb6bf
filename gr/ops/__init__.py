"""gr's kernels that are not HSTU's (HSTU's are in ``gr.hstu.kernels``): one package per op, each its
dispatch (``__init__``: the public function) over backend modules named by backend, and the native
build of all of gr's fused CPU kernels.

* ``sampled_softmax``: ``sampled_softmax_loss`` (``cpu``, ``pytorch``);
* ``random``: ``keep_mask`` and ``randint``, counter-based on CPU.

Each op's C++ sits beside its CPU code; ``csrc/`` holds the shared headers (GEMM, SiLU, BLAS,
threads) and the GEMM and SiLU test ops; ``native`` builds them, with the C++ of the packages above
that add theirs (``gr.hstu.kernels``), into one library on first use.
Nothing here imports ``gr.hstu``, ``gr.train`` or ``gr.serving``: they import ``gr.ops``.
"""
