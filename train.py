"""``python train.py ARGS`` is ``gr train ARGS`` (kept for torchrun, which launches a script:
``torchrun --nproc_per_node N train.py --config configs/X.yaml ...``)."""

import sys

from gr.commands.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
