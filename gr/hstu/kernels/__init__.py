"""HSTU's fused kernels: one package per op, each its dispatch (``__init__``: the public function) over
backend modules named by backend, with the op's call object and, where ``gr.train.memory`` needs one,
its cost model (``cost``).

* ``attention``: ``hstu_attention`` (backends ``pytorch``, ``cpu``, ``triton``, ``ascend``,
  ``ascend_triton``);
* ``cached_attention``: ``hstu_cached_attention``, the serving analogue (``pytorch``, ``cpu`` with
  its fused C++ ``gr_cpu_cached``, ``triton`` with its own kernel, and the Ascend ones through their
  training kernel: ``by_concat``);
* ``layer_ops``: the HSTU layer's steps around attention (``project``, ``combine``,
  ``norm_mul_dropout``, ``stack_input``; fused CPU ops in ``cpu``).

Each op's C++ sits beside its CPU code and includes the shared headers of ``gr/ops/csrc``; importing
this package adds it (``SOURCES``) to the library ``gr.ops.native`` builds. Nothing here imports the
rest of ``gr.hstu``: the layer and stack import these.
"""

from pathlib import Path

from gr.ops.native import add_sources

KERNELS = Path(__file__).resolve().parent
SOURCES = (
    KERNELS / "attention" / "cpu_fused_attention.cpp",
    KERNELS / "cached_attention" / "cpu_cached_attention.cpp",
    KERNELS / "layer_ops" / "layer_ops.cpp",
)
add_sources(SOURCES)
