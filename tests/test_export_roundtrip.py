"""Sliced export round trips: ONNX slices = PyTorch, rebuilt HSTU = trained HSTU, the whole
chain from the export alone = the trained model's predictions; user-defined DNNs; atomic writes.
"""

import json
import os

import numpy as np
import onnxruntime as ort
import pytest
import torch
from torchrec import KeyedJaggedTensor

from gr import GRInput, GRModel, HSTUConfig, PostfixDNN, PrefixDNN
from gr.export import ExportError, check_export, export_model, load_hstu, open_export
from gr.export.format import FORMAT_VERSION, HSTU_CONFIG, SPARSE_INI
from gr.export.hstu_slice import from_slice, slice_tensor_shapes, to_slice
from gr.hstu import HSTU
from gr.postfix_dnn import RetrievalHead
from gr.serving import Ranker
from gr.utils.atomic import process_umask, write_json
from helpers.models import (
    DENSE_DIMS,
    HSTU_KW,
    as_served,
    build_custom_model,
    build_ranking_model,
    build_retrieval_model,
    random_batch,
    rank_all,
    requests_from_batch,
    write_id_mappings,
)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    model = build_ranking_model()
    root = tmp_path_factory.mktemp("shipped")
    path = export_model(model, root / "export", id_mappings_dir=write_id_mappings(root / "maps"), dense_dims=DENSE_DIMS)
    return model, path


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    model = build_custom_model()
    path = export_model(model, tmp_path_factory.mktemp("custom") / "export", dense_dims={"price": 3, "context": 5})
    return model, path


@pytest.fixture(scope="module")
def retrieval(tmp_path_factory):
    model = build_retrieval_model()
    return model, export_model(model, tmp_path_factory.mktemp("retrieval") / "export")


@pytest.mark.parametrize("which", ["shipped", "custom", "retrieval"])
def test_onnx_slices_match_pytorch_for_several_row_counts(which, request):
    model, path = request.getfixturevalue(which)
    graph = open_export(path).graph
    prefix = ort.InferenceSession(str(path / "prefix_dnn/model.onnx"))
    postfix = ort.InferenceSession(str(path / "postfix_dnn/model.onnx"))
    prefix_inputs = graph.slice("prefix_dnn").inputs
    postfix_inputs = graph.slice("postfix_dnn").inputs
    assert [t.name for t in prefix_inputs] == list(model.prefix_dnn.feature_names)
    assert [t.name for t in graph.slice("postfix_dnn").outputs] == list(model.postfix_dnn.output_names)
    for rows in (1, 2, 7, 33):
        feats = {t.name: torch.randn(rows, t.shape[1]) for t in prefix_inputs}
        (got,) = prefix.run(None, {n: x.numpy() for n, x in feats.items()})
        with torch.no_grad():
            want = model.prefix_dnn(feats)
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-5)
        hidden = torch.randn(rows, 16)
        common = {t.name: torch.randn(rows, t.shape[1]) for t in postfix_inputs[1:]}
        got = postfix.run(None, {"hidden": hidden.numpy(), **{n: x.numpy() for n, x in common.items()}})
        with torch.no_grad():
            want = model.postfix_dnn(hidden, common)
        for name, value in zip(model.postfix_dnn.output_names, got):
            assert value.shape == tuple(want[name].shape)
            np.testing.assert_allclose(value, want[name].numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("which", ["shipped", "custom"])
def test_rebuilt_hstu_matches_trained_on_jagged_batches_with_targets(which, request):
    model, path = request.getfixturevalue(which)
    rebuilt = load_hstu(path)
    assert rebuilt.config == model.hstu.config
    lengths, targets = [9, 1, 23, 14], [3, 1, 5, 0]
    offsets = torch.tensor([0, 9, 10, 33, 47])
    x = torch.randn(47, 16)
    ts = torch.cat([torch.sort(torch.randint(0, 10**6, (n,))).values for n in lengths])
    with torch.no_grad():
        want = model.hstu(x, offsets, 23, ts, torch.tensor(targets))
        got = rebuilt(x, offsets, 23, ts, torch.tensor(targets))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("which", ["shipped", "custom"])
def test_chain_from_export_alone_reproduces_trained_predictions_on_test_users(which, request):
    model, path = request.getfixturevalue(which)
    batch = random_batch(model, [12, 30, 5, 1, 19], [4, 7, 1, 1, 3], seed=3)
    with torch.no_grad():
        want = as_served(model(batch).predictions)
    ranker = Ranker.load(path, micro_batch=3)
    requests = requests_from_batch(batch)
    for use_cache in (True, False):
        got = rank_all(ranker, requests, use_cache=use_cache)
        assert got.keys() == want.keys()
        for task, value in want.items():
            np.testing.assert_allclose(got[task], value, rtol=0, atol=1e-5)


def test_retrieval_rank_scores_each_candidate_by_the_trained_query_at_the_last_history_token(retrieval):
    """A retrieval export's rank: one score per candidate, the cosine that training divides by its
    temperature and evaluation ranks by (last history token's query . normalised item row)."""
    model, path = retrieval
    batch = random_batch(model, [12, 30, 5, 19], [4, 7, 1, 3], seed=3)
    items = RetrievalHead.item_embedding(model.embeddings.table_weight("item")).detach()
    ranker = Ranker.load(path, micro_batch=3)
    for request in requests_from_batch(batch):
        history = request["history"]
        n = len(history["item_id"])
        alone = GRInput(
            seq_offsets=torch.tensor([0, n]),
            max_seq_len=n,
            timestamps=torch.from_numpy(history["timestamps"]),
            sequence_ids=KeyedJaggedTensor.from_lengths_sync(
                ["item_id"], torch.from_numpy(history["item_id"]), torch.tensor([n])
            ),
        )
        with torch.no_grad():
            query = model(alone).predictions["query"][-1]  # the history's last token: what training scores
        want = items[torch.from_numpy(request["candidates"]["item_id"])] @ query
        for use_cache in (True, False, True):
            got = ranker.rank(request["user_id"], request["history"], request["candidates"], use_cache=use_cache)
            assert list(got.scores) == ["retrieval"]
            np.testing.assert_allclose(got.scores["retrieval"], want.numpy(), rtol=0, atol=1e-5)


def test_hstu_slice_names_are_the_documented_schema_and_map_back_exactly():
    for overrides in ({}, {"position_embedding": False, "position_buckets": 0, "time_buckets": 0}, {"num_layers": 3}):
        cfg = HSTUConfig(**{**HSTU_KW, **overrides})
        state = HSTU(cfg).state_dict()
        sliced = to_slice(state, cfg, "float32")
        assert {n: tuple(t.shape) for n, t in sliced.items()} == slice_tensor_shapes(cfg)
        back = from_slice(sliced, cfg)
        assert back.keys() == state.keys() and all(torch.equal(back[n], state[n]) for n in state)


def test_config_json_has_hugging_face_keys_hstu_keys_and_the_format_version(shipped):
    model, path = shipped
    values = json.loads((path / HSTU_CONFIG).read_text())
    cfg = model.hstu.config
    assert values["model_type"] == "hstu" and values["torch_dtype"] == "float32"
    assert values["format_version"] == FORMAT_VERSION
    assert (
        values["hidden_size"],
        values["num_hidden_layers"],
        values["num_attention_heads"],
        values["max_position_embeddings"],
    ) == (cfg.hidden_dim, cfg.num_layers, cfg.num_heads, cfg.max_seq_len)
    assert values["alpha"] == cfg.alpha and values["attn_alpha"] is None
    assert {"attention_dim", "linear_dim", "time_bucketing", "query_time", "eviction_block"} <= set(values)


def test_a_bfloat16_hstu_slice_stores_half_the_bytes_and_scores_within_bf16_rounding(shipped, tmp_path):
    model, path = shipped
    half = export_model(model, tmp_path / "bf16", dense_dims=DENSE_DIMS, hstu_dtype="bfloat16")
    assert json.loads((half / HSTU_CONFIG).read_text())["torch_dtype"] == "bfloat16"
    full_bytes, half_bytes = ((p / "hstu/model.safetensors").stat().st_size for p in (path, half))
    assert half_bytes < 0.6 * full_bytes
    rounded = {n: t.to(torch.bfloat16).float() for n, t in model.hstu.state_dict().items()}
    loaded = load_hstu(half).state_dict()
    assert all(torch.equal(loaded[n], rounded[n]) for n in rounded)


def test_sparse_ini_maps_features_to_tables_and_id_mappings(shipped):
    _, path = shipped
    sparse = open_export(path).sparse
    assert sparse.features["item_id"].table == "item" and sparse.features["item_id"].id_mapping == "id_maps/items.tsv"
    assert sparse.features["genre"].id_mapping == "id_maps/genre.tsv"
    assert sparse.features["user_id"].kind == "common" and sparse.features["user_id"].pooling == "mean"
    assert sparse.features["user_id"].id_mapping is None
    assert (sparse.tables["item"].rows, sparse.tables["item"].dim) == (50, 16)
    assert (path / "sparse/id_maps/items.tsv").read_text().endswith("1001\n")
    assert "id_mapping = id_maps/items.tsv" in (path / SPARSE_INI).read_text()


def test_export_refuses_to_overwrite_unless_asked_and_replaces_atomically(shipped, tmp_path):
    model, _ = shipped
    target = tmp_path / "export"
    target.mkdir()
    (target / "keep.txt").write_text("old")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_model(model, target, dense_dims=DENSE_DIMS)
    assert (target / "keep.txt").read_text() == "old"

    with pytest.raises(ExportError, match="user_score"):  # fails after part of the export was written
        export_model(model, target, overwrite=True)
    assert (target / "keep.txt").read_text() == "old", "a failed export must leave the old directory untouched"
    export_model(model, target, dense_dims=DENSE_DIMS, overwrite=True)
    assert not (target / "keep.txt").exists() and check_export(target) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"], "no temporary directories are left behind"


def test_unexportable_module_error_names_the_module_and_the_onnx_failure(shipped, tmp_path):
    model, _ = shipped

    class ViaPython(PrefixDNN):
        feature_names = ("item_id",)

        def forward(self, features):
            x = features["item_id"]
            return torch.tensor(x.tolist()) * 2.0  # token-wise, but leaves the traceable graph

    bad = GRModel(model.hstu.config, ViaPython(), model.postfix_dnn, list(model.embeddings.tables.values()))
    with pytest.raises(ExportError, match=r"prefix_dnn \(.*ViaPython\): ONNX export failed: \w+"):
        export_model(bad, tmp_path / "export", dense_dims=DENSE_DIMS)

    class BranchHead(PostfixDNN):
        output_names = ("score",)

        def forward(self, hidden, common):
            if float(hidden.mean()) > 0:  # a Python branch on tensor values: no static graph
                return {"score": hidden.sum(-1)}
            return {"score": -hidden.sum(-1)}

    bad = GRModel(model.hstu.config, model.prefix_dnn, BranchHead(), list(model.embeddings.tables.values()))
    with pytest.raises(ExportError, match=r"postfix_dnn \(.*BranchHead\): ONNX export failed: \w+") as info:
        export_model(bad, tmp_path / "export2", dense_dims=DENSE_DIMS)
    assert "data-dependent" in str(info.value), "the message carries torch.export's reason"
    assert not (tmp_path / "export2").exists()


def test_position_mixing_prefix_and_unknown_dense_dims_are_refused(shipped, tmp_path):
    model, _ = shipped

    class Mixer(PrefixDNN):
        feature_names = ("item_id",)

        def forward(self, features):
            x = features["item_id"]
            return x - x.mean(0, keepdim=True)

    tables = list(model.embeddings.tables.values())
    with pytest.raises(ExportError, match="Mixer.*token-wise"):
        export_model(
            GRModel(model.hstu.config, Mixer(), model.postfix_dnn, tables), tmp_path / "a", dense_dims=DENSE_DIMS
        )
    with pytest.raises(ExportError, match="user_score.*dense_dims"):
        export_model(model, tmp_path / "b")


def test_every_exported_file_gets_the_permissions_the_umask_gives(shipped):
    """Readable by a serving account of another uid under the usual umask (0644 under 022), not
    the 0600 of a private temporary file."""
    _, export = shipped
    expected = 0o666 & ~process_umask()
    modes = {str(p.relative_to(export)): p.stat().st_mode & 0o777 for p in export.rglob("*") if p.is_file()}
    assert modes and all(mode == expected for mode in modes.values()), modes


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)], ids=["022", "077", "002"])
def test_atomic_writes_follow_the_umask(tmp_path, umask, mode):
    before = os.umask(umask)
    try:
        assert process_umask() == umask
        write_json(tmp_path / "metrics.json", {"hr@10": 0.2})
    finally:
        os.umask(before)
    assert (tmp_path / "metrics.json").stat().st_mode & 0o777 == mode
