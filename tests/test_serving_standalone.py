"""The HSTU slice and the serving runtime load and score in a process that cannot import the
training code (an import guard refuses torchrec, lightning and gr.model/train/data/sparse/DNNs)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from gr.export import export_model
from test_export_roundtrip import DENSE_DIMS, build_ranking_model, random_batch, requests_from_batch

BLOCKED = ("torchrec", "fbgemm_gpu", "lightning", "pytorch_lightning", "gr.model", "gr.train", "gr.data",
           "gr.sparse", "gr.prefix_dnn", "gr.postfix_dnn", "gr.export.writer")

SCRIPT = r"""
import importlib.abc, json, sys
import numpy as np

BLOCKED = tuple(json.loads(sys.argv[1]))

class Guard(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"import guard: {name} is training code")
        return None

sys.meta_path.insert(0, Guard())
import torch
from gr.export import load_hstu
from gr.serving import Ranker

export_dir, work = sys.argv[2], sys.argv[3]
inputs = np.load(f"{work}/hstu_inputs.npz")
hstu = load_hstu(export_dir)
with torch.no_grad():
    hidden = hstu(torch.from_numpy(inputs["x"]), torch.from_numpy(inputs["offsets"]), int(inputs["max_len"]),
                  torch.from_numpy(inputs["timestamps"]), torch.from_numpy(inputs["num_targets"]))
ranker = Ranker.load(export_dir, micro_batch=2)
scores = {}
for request in json.load(open(f"{work}/requests.json")):
    result = ranker.rank(request["user_id"], request["history"], request["candidates"], request["common_features"])
    for task, value in result.scores.items():
        scores.setdefault(task, []).append(value)
leaked = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED))
np.savez(f"{work}/out.npz", hidden=hidden.numpy(), **{k: np.concatenate(v) for k, v in scores.items()})
print(json.dumps({"leaked": leaked}))
"""


def test_hstu_and_ranker_work_in_a_process_without_training_code(tmp_path):
    model = build_ranking_model()
    export_dir = export_model(model, tmp_path / "export", dense_dims=DENSE_DIMS)
    batch = random_batch(model, [14, 6, 21], [3, 2, 4], seed=11)
    with torch.no_grad():
        want_scores = model(batch).predictions
        x = torch.randn(int(batch.seq_offsets[-1]), 16)
        want_hidden = model.hstu(x, batch.seq_offsets, batch.max_seq_len, batch.timestamps, batch.num_targets)
    np.savez(tmp_path / "hstu_inputs.npz", x=x.numpy(), offsets=batch.seq_offsets.numpy(), max_len=batch.max_seq_len,
             timestamps=batch.timestamps.numpy(), num_targets=batch.num_targets.numpy())
    parts = ("history", "candidates", "common_features")
    requests = [{**r, **{part: {k: v.tolist() for k, v in r[part].items()} for part in parts}}
                for r in requests_from_batch(batch)]
    (tmp_path / "requests.json").write_text(json.dumps(requests))

    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    run = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(BLOCKED), str(export_dir), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"leaked": []}
    out = np.load(tmp_path / "out.npz")
    np.testing.assert_allclose(out["hidden"], want_hidden.numpy(), rtol=0, atol=1e-5)
    for task, value in want_scores.items():
        np.testing.assert_allclose(out[task], value.numpy(), rtol=0, atol=1e-5)


def test_the_import_guard_refuses_training_code(tmp_path):
    probe = SCRIPT.split("import torch")[0] + "import gr.model\n"
    run = subprocess.run([sys.executable, "-c", probe, json.dumps(BLOCKED)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}, timeout=60)
    assert run.returncode != 0 and "import guard: gr.model is training code" in run.stderr
