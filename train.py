"""Train a generative recommender: ``python train.py --config configs/X.yaml [--out DIR] [--resume DIR] [--a.b v]``.

Runs on one process, or on several with ``torchrun --nproc_per_node N train.py ...``.
"""
import sys

from gr.devices import configure_backend_autoload

configure_backend_autoload()  # before torch is imported: torch_npu autoloads only on an NPU host

from gr.train.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
