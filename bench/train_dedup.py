"""Training throughput on the ML-100K retrieval recipe with and without id dedup ("unique before lookup").

    python bench/train_dedup.py [--config configs/ml100k_hstu.yaml] [--steps 6] [--data.path ...]
    (ML-100K from $GR_ML100K_DIR or data/ml-100k unless --config or --data.path is given)
    torchrun --nproc_per_node 2 bench/train_dedup.py ...   # tables row-wise over 2 ranks
    python bench/train_dedup.py --smoke   # 2 steps of a tiny synthetic model: checks it runs

Builds the recipe's model, shards it with TorchRec (gloo; one rank, or torchrun's), and times full
training steps (sampling, sharded lookup, HSTU, sampled softmax, backward with the fused
embedding optimizer, dense AdamW) on the same batches, alternating dedup off / on so that
both see the same machine load. Also times the sparse part alone (lookup forward +
backward) on the batches' item ids. Prints one line per setting; the last line is one
JSON object: config, ranks, steps, batch_size, item_ids_per_rank_batch,
distinct_item_ids_per_rank_batch, {no_dedup,dedup}_samples_per_s, {no_dedup,dedup}_tokens_per_s,
{no_dedup,dedup}_sparse_ms_per_batch, train_speedup, sparse_speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import smoke  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.autograd.profiler import record_function  # noqa: E402
from torchrec.optim.optimizers import in_backward_optimizer_filter  # noqa: E402

from gr.commands.train import parse_args  # noqa: E402
from gr.data.datamodule import SequenceDataModule  # noqa: E402
from gr.sparse.sharding import shard_model  # noqa: E402
from gr.train.build import dense_optimizer, seeded_model  # noqa: E402
from gr.train.config import load_config  # noqa: E402
from gr.train.tasks import RetrievalTask  # noqa: E402

# --smoke: the quickstart recipe shrunk to a few batches of a tiny model (given overrides still win).
SMOKE_OVERRIDES = [
    "--config",
    "configs/quickstart.yaml",
    "--data.synthetic.num_users",
    "64",
    "--data.synthetic.num_items",
    "50",
    "--data.synthetic.min_len",
    "5",
    "--data.synthetic.max_len",
    "20",
    "--data.max_seq_len",
    "20",
    "--model.hstu.max_seq_len",
    "20",
    "--model.hstu.num_layers",
    "1",
    "--task.retrieval.num_negatives",
    "8",
    "--data.batch_size",
    "16",
]


def build(config, spec):
    model = seeded_model(config, spec)
    task = RetrievalTask(
        config.task.retrieval, spec.sequence[config.task.retrieval.item_feature], model.postfix_dnn.item_embedding
    )
    dmp = shard_model(model, config.sparse.optimizer, torch.device("cpu"))
    dense = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
    return dmp, task, dense_optimizer(config.optimizer, dense)


def train_step(dmp, task, optimizer, batch, generator, precision: str = "32-true") -> None:
    """One training step; "bf16-mixed" runs forward and loss under CPU bf16 autocast, as Lightning does."""
    with record_function("phase: sampling"):
        inputs = task.training_inputs(batch, generator)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        with record_function("phase: forward"):
            output = dmp(inputs)
        with record_function("phase: loss"):
            loss = task.loss(output, inputs)["loss"]
    with record_function("phase: backward (with the fused embedding optimizer)"):
        loss.backward()
    with record_function("phase: dense optimizer"):
        optimizer.step()
        optimizer.zero_grad()


def sparse_step(dmp, batch) -> None:
    out, _ = dmp.module.embeddings(batch.sequence_ids, None)
    sum(v.sum() for v in out.values()).backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed training steps per setting")
    own, rest = smoke.parse_args(parser, {"steps": 2}, known=True)
    if own.smoke:
        rest = [*SMOKE_OVERRIDES, *rest]
    recipe = ["--config", "configs/ml100k_hstu.yaml", "--data.path", str(smoke.ML_100K)]  # given overrides win
    args, overrides = parse_args([*recipe, *rest] if "--config" not in rest else rest)
    config = load_config(args.config, overrides)
    store = tempfile.TemporaryDirectory()
    if "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"file://{store.name}/pg", rank=0, world_size=1)
    world = dist.get_world_size()
    data = SequenceDataModule(config.data)
    data.setup()
    spec = data.feature_spec()
    batches = list(data.train_dataloader())
    setups = {}
    for dedup in (False, True):
        dmp, task, optimizer = build(config, spec)
        dmp.module.embeddings.dedup = dedup
        setups[dedup] = (dmp, task, optimizer)
    timings = {False: [], True: []}
    sparse_timings = {False: [], True: []}
    generator = torch.Generator()
    for step in range(own.steps + 1):  # step 0 warms up
        batch = batches[step % len(batches)]
        for dedup in (False, True):
            dmp, task, optimizer = setups[dedup]
            generator.manual_seed(step)
            start = time.perf_counter()
            train_step(dmp, task, optimizer, batch, generator)
            middle = time.perf_counter()
            sparse_step(dmp, batch)
            if step:
                timings[dedup].append(middle - start)
                sparse_timings[dedup].append(time.perf_counter() - middle)
    timed = [batches[s % len(batches)] for s in range(1, own.steps + 1)]
    samples = sum(int(b.seq_offsets.numel() - 1) for b in timed)
    tokens = sum(int(b.seq_offsets[-1]) for b in timed)
    result = {
        "config": str(args.config),
        "ranks": world,
        "steps": own.steps,
        "batch_size": config.data.batch_size,
        "item_ids_per_rank_batch": tokens / own.steps,
        "distinct_item_ids_per_rank_batch": sum(int(b.sequence_ids.values().unique().numel()) for b in timed)
        / own.steps,
    }
    samples, tokens = world * samples, world * tokens  # every rank trains on its share of each global batch
    for dedup, name in ((False, "no_dedup"), (True, "dedup")):
        seconds = sum(timings[dedup])
        result[f"{name}_samples_per_s"] = samples / seconds
        result[f"{name}_tokens_per_s"] = tokens / seconds
        result[f"{name}_sparse_ms_per_batch"] = 1000 * sum(sparse_timings[dedup]) / own.steps
        if dist.get_rank() == 0:
            print(
                f"{name:9s} {samples / seconds:8.1f} samples/s  {tokens / seconds:9.0f} tokens/s  "
                f"sparse fwd+bwd {result[f'{name}_sparse_ms_per_batch']:.1f} ms/batch",
                flush=True,
            )
    result["train_speedup"] = result["dedup_samples_per_s"] / result["no_dedup_samples_per_s"]
    result["sparse_speedup"] = result["no_dedup_sparse_ms_per_batch"] / result["dedup_sparse_ms_per_batch"]
    if dist.get_rank() == 0:
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
