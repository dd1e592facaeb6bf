"""``Ranker.generate`` on an export: greedy = the trained model's step-by-step argmax, speculative
(pool and draft-model drafts) = greedy, beam/sample options, the user cache, bad requests; the
warm-up leaves the first real request nothing to import."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrec import KeyedJaggedTensor

from gr import GRInput, GRModel
from gr.export import export_model
from gr.generation.budget import AdaptiveBudget, SharedBudget
from gr.generation.drafts import ModelDraftSource, PoolDraftSource
from gr.generation.pools import GroupedPools, SequencePool
from gr.generation.speculative_retrieval import SpeculativeRetrieval
from gr.postfix_dnn import RetrievalHead
from gr.serving import Ranker, RequestError
from gr.serving.generate import ServingGenerativeModel
from helpers.models import build_generative_model, users

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    target, draft = build_generative_model(2, 3), build_generative_model(1, 4)
    return target, export_model(target, root / "target"), export_model(draft, root / "draft")


REQUEST_TIME = 2 * 10**6


def trained_greedy(model: GRModel, history, k: int):
    """Greedy by full forwards of the trained model: argmax of query . normalised item rows."""
    seq, times = history["item_id"].tolist(), history["timestamps"].tolist()
    items = RetrievalHead.item_embedding(model.embeddings.table_weight("item"))
    out = []
    with torch.no_grad():
        for _ in range(k):
            n = len(seq)
            batch = GRInput(
                seq_offsets=torch.tensor([0, n]),
                max_seq_len=n,
                timestamps=torch.tensor(times),
                sequence_ids=KeyedJaggedTensor.from_lengths_sync(["item_id"], torch.tensor(seq), torch.tensor([n])),
            )
            scores = items @ model(batch).predictions["query"][-1]
            scores[torch.tensor(seq)] = float("-inf")
            out.append(int(scores.argmax()))
            seq.append(out[-1])
            times.append(REQUEST_TIME)
    return out


def test_served_greedy_equals_the_trained_models_step_by_step_argmax(exports):
    model, path, _ = exports
    ranker = Ranker.load(path, threads=1)
    for user, history in users(3):
        result = ranker.generate(user, history, 6, request_time=REQUEST_TIME)
        assert result.items == trained_greedy(model, history, 6)
        assert result.cache_status == "miss" and result.stats.passes == 5
        assert not {"passes", "accepted"} & set(result.to_json()), "plain greedy drafts nothing to report"
    user, history = users(1)[0]
    again = ranker.generate(user, history, 6, request_time=REQUEST_TIME)
    assert again.cache_status == "hit" and again.items == trained_greedy(model, history, 6)


@pytest.mark.parametrize("shared", [False, True])
def test_served_speculative_greedy_with_pools_and_a_draft_model_equals_greedy(exports, shared):
    _, path, draft_path = exports
    ranker = Ranker.load(path, threads=1)
    population = users(10, seed=1)
    slates = [ranker.generate(u, h, 8, request_time=REQUEST_TIME).items for u, h in population]
    sequences = [h["item_id"].tolist() + s for (_, h), s in zip(population, slates)]
    catalogue, _ = ranker.catalogue()
    embeddings = torch.stack([catalogue.index.items[h["item_id"][-1]] for _, h in population])
    grouped = GroupedPools.build(sequences[:8], embeddings[:8], num_groups=2, attributes=["a", "b"] * 4)
    draft = Ranker.load(draft_path, threads=1).catalogue()[0]
    sources = [
        PoolDraftSource(grouped, max_depth=4, max_nodes=8, min_history=8),
        ModelDraftSource(ServingGenerativeModel(draft, {}), draft.index, max_depth=3),
    ]
    everyone = SequencePool()
    for seq in sequences[:8]:
        everyone.add(seq)
    sources.append(PoolDraftSource(everyone, max_depth=6))
    for source in sources:
        accepted, budget = 0, SharedBudget() if shared else None  # one budget across the source's requests
        for (user, history), want in zip(population, slates):
            got = ranker.generate(
                user, history, 8, request_time=REQUEST_TIME, draft=source, attribute="a", budget=budget
            )
            assert got.items == want
            assert got.to_json()["accepted"] == got.stats.accepted and got.to_json()["passes"] == got.stats.passes
            accepted += got.stats.accepted
        if source is sources[-1]:
            assert accepted > 0, "the pool holds eight of these users' slates: some drafts must be accepted"


def test_beam_and_sampling_options_and_bad_requests(exports):
    _, path, _ = exports
    ranker = Ranker.load(path, threads=1)
    user, history = users(1, seed=2)[0]
    greedy = ranker.generate(user, history, 5, request_time=REQUEST_TIME).items
    assert ranker.generate(user, history, 5, "beam", request_time=REQUEST_TIME, beam_width=1).items == greedy
    drawn = [ranker.generate(user, history, 5, "sample", request_time=REQUEST_TIME, seed=9).items for _ in range(2)]
    assert drawn[0] == drawn[1] and not set(drawn[0]) & set(history["item_id"].tolist())
    repeats = ranker.generate(user, history, 5, exclude_seen=False, request_time=REQUEST_TIME).items
    assert len(repeats) == 5
    assert (
        ranker.generate(
            user,
            history,
            5,
            request_time=REQUEST_TIME,
            speculative_retrieval=SpeculativeRetrieval(cache_size=4, stride=2),
        ).items
        == greedy
    )
    with pytest.raises(RequestError, match="strategy"):
        ranker.generate(user, history, 5, "topp")
    with pytest.raises(RequestError, match="k: expected"):
        ranker.generate(user, history, 0)
    with pytest.raises(RequestError, match="history: empty"):
        ranker.generate(user, {"item_id": [], "timestamps": []}, 3)
    with pytest.raises(RequestError, match="draft"):
        ranker.generate(user, history, 3, "beam", draft=PoolDraftSource(SequencePool()))
    with pytest.raises(RequestError, match="budget"):
        ranker.generate(user, history, 3, budget=AdaptiveBudget())


def test_generate_cli_prints_the_same_slate_as_the_api(exports, tmp_path, capsys):
    from gr.commands.serve import main as serving_main

    _, target_dir, _ = exports
    user, history = users(1, seed=5)[0]
    request = {"user_id": user, "history": {k: v.tolist() for k, v in history.items()}, "request_time": REQUEST_TIME}
    file = tmp_path / "request.json"
    file.write_text(json.dumps(request))
    assert serving_main(["generate", str(target_dir), "--request", str(file), "--k", "4"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = Ranker.load(target_dir).generate(user, history, 4, request_time=REQUEST_TIME).items
    assert printed["items"] == expected and len(expected) == 4


FIRST_REQUESTS = r"""
import json, sys
import numpy as np
from gr.serving import Ranker
from gr.serving.request import RecommendRequest

ranker = Ranker.load(sys.argv[1])
ranker.warm_up()
before = set(sys.modules)
history = {"item_id": np.array([3, 5, 8]), "timestamps": np.array([10, 20, 30])}
ranker.recommend(RecommendRequest("u", history, 4))
ranker.rank("v", history, {"item_id": np.array([1, 2])})
ranker.generate("w", history, 3)
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_after_the_warm_up_the_first_requests_of_each_kind_import_nothing(exports):
    """What a first request imports (numpy.ma for recommend's exclusion of seen items: ~20 ms) is
    the warm-up's to import; a fresh interpreter, since the test process has imported much more."""
    _, path, _ = exports
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PYTHONPATH": str(Path(__file__).parents[1])}
    run = subprocess.run(
        [sys.executable, "-c", FIRST_REQUESTS, str(path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []
