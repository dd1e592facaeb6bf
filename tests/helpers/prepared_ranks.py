"""Train under torchrun on a prepared dataset, each rank writing down what it streamed.

``python -m torch.distributed.run --nproc_per_node N tests/helpers/prepared_ranks.py CONFIG.yaml OUT``
runs ``gr.train.train`` of CONFIG into OUT; rank r writes ``OUT/rank<r>.json``: {"shards": the shards
it read, "train": {epoch: [[dataset user id of each sample] per batch]}, "val": {epoch: batches},
"test": batches}.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from lightning.pytorch import Callback  # noqa: E402

from gr.commands.train import end_process_group  # noqa: E402
from gr.train import run  # noqa: E402
from gr.train.config import load_config  # noqa: E402


class Recorder(Callback):
    def __init__(self) -> None:
        self.seen = {"shards": [], "train": {}, "val": {}, "test": 0}

    def on_train_start(self, trainer, pl_module) -> None:
        split = trainer.train_dataloader.dataset
        self.seen["shards"] = sorted({split.data.row_groups[p].shard for p in split.groups})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen["train"].setdefault(str(trainer.current_epoch), []).append(batch.labels["user"].tolist())

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        epoch = str(trainer.current_epoch)
        self.seen["val"][epoch] = self.seen["val"].get(epoch, 0) + 1

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.seen["test"] += 1


if __name__ == "__main__":
    recorder = Recorder()
    make_trainer = run.make_trainer
    run.make_trainer = lambda config, out_dir, extra=(), resumed=None: make_trainer(
        config, out_dir, [*extra, recorder], resumed
    )
    out = Path(sys.argv[2])
    run.train(load_config(sys.argv[1]), out)
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(recorder.seen))
    end_process_group()
