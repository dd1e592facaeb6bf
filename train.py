"""Train a generative recommender: ``python train.py --config configs/X.yaml [--out DIR] [--resume DIR] [--a.b v]``.

Runs on one process, or on several with ``torchrun --nproc_per_node N train.py ...``.
"""
import os
import sys

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from gr.train.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
