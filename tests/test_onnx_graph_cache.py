"""An export of an architecture translated before reuses its ONNX graph with its own weights, and
the file equals a fresh translation; an entry that is unreadable or wrong is never served."""

from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

from gr.export import onnx_graph_cache
from gr.export.format import ExportError
from gr.export.writer import _export_onnx, export_model
from helpers.models import DENSE_DIMS, build_ranking_model, perturb

SLICES = ("prefix_dnn/model.onnx", "postfix_dnn/model.onnx")


class Scaled(nn.Module):
    """A slice-shaped module (``forward(*features)``, rows first) small enough to translate in a blink."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 3)

    def forward(self, *features: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(features[0]))


def export_scaled(module: nn.Module, path: Path, input_names=("x",)) -> None:
    example = (torch.randn(3, module.linear.in_features),)
    _export_onnx("scaled", module, module.eval(), example, list(input_names), ["y"], "rows", path)


def entries(cache: Path):
    return sorted(cache.glob("*.onnx"))


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv(onnx_graph_cache.CACHE_DIR_ENV, str(directory))
    return directory


def test_a_model_of_an_exported_architecture_reuses_its_graphs_and_equals_a_fresh_translation(
    tmp_path, cache, monkeypatch
):
    first, second = build_ranking_model(), perturb(build_ranking_model(), seed=1)
    export_model(first, tmp_path / "first", dense_dims=DENSE_DIMS)
    stored = {path: path.stat().st_mtime_ns for path in entries(cache)}
    assert len(stored) == 2  # one graph per slice, weights left out
    weights = [i for path in stored for i in onnx.load(str(path)).graph.initializer if i.name.endswith("weight")]
    assert weights and not any(i.raw_data for i in weights)

    export_model(second, tmp_path / "reused", dense_dims=DENSE_DIMS)
    monkeypatch.setenv(onnx_graph_cache.CACHE_DIR_ENV, "off")
    export_model(second, tmp_path / "fresh", dense_dims=DENSE_DIMS)
    for name in SLICES:
        reused = (tmp_path / "reused" / name).read_bytes()
        assert reused == (tmp_path / "fresh" / name).read_bytes()
        assert reused != (tmp_path / "first" / name).read_bytes()
    assert {path: path.stat().st_mtime_ns for path in entries(cache)}.keys() == stored.keys()


def test_off_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(onnx_graph_cache.CACHE_DIR_ENV, "off")
    assert onnx_graph_cache.cache_directory() is None
    export_scaled(Scaled(), tmp_path / "model.onnx")
    assert onnx.load(str(tmp_path / "model.onnx")).graph.initializer


def test_the_key_follows_the_architecture_and_the_input_names_not_the_weights(tmp_path, cache):
    export_scaled(Scaled(), tmp_path / "a.onnx")
    export_scaled(Scaled(), tmp_path / "b.onnx")
    assert len(entries(cache)) == 1
    export_scaled(Scaled(dim=5), tmp_path / "c.onnx")
    export_scaled(Scaled(), tmp_path / "d.onnx", input_names=("features",))
    assert len(entries(cache)) == 3


def test_an_unreadable_entry_is_a_miss_and_is_replaced(tmp_path, cache):
    export_scaled(Scaled(), tmp_path / "a.onnx")
    (entry,) = entries(cache)
    entry.write_bytes(b"\x08\x07not a model")
    module = Scaled()
    export_scaled(module, tmp_path / "b.onnx")
    assert entries(cache) == [entry] and onnx.load(str(entry)).graph.node
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(tmp_path / "b.onnx")).graph.initializer}
    assert (weights["linear.weight"] == module.linear.weight.detach().numpy()).all()


def test_an_entry_that_answers_unlike_pytorch_is_discarded_and_the_slice_translated_afresh(tmp_path, cache):
    export_scaled(Scaled(), tmp_path / "a.onnx")
    (entry,) = entries(cache)
    wrong = onnx.load(str(entry))
    (relu,) = [node for node in wrong.graph.node if node.op_type == "Relu"]
    relu.op_type = "Sigmoid"
    entry.write_bytes(wrong.SerializeToString())
    module = Scaled()
    export_scaled(module, tmp_path / "b.onnx")
    assert [n.op_type for n in onnx.load(str(tmp_path / "b.onnx")).graph.node].count("Relu") == 1
    assert [n.op_type for n in onnx.load(str(entry)).graph.node].count("Relu") == 1


def test_a_graph_whose_weights_were_folded_into_other_constants_is_not_kept(tmp_path, cache):
    class Folded(Scaled):
        def forward(self, *features: torch.Tensor) -> torch.Tensor:
            return features[0] @ (self.linear.weight.t() * 2.0)

    export_scaled(Folded(), tmp_path / "a.onnx")
    names = {i.name for i in onnx.load(str(tmp_path / "a.onnx")).graph.initializer}
    assert "linear.weight" not in names
    assert entries(cache) == []


def test_a_module_that_cannot_be_traced_fails_as_before_naming_the_slice(tmp_path, cache):
    class Untraceable(Scaled):
        def forward(self, *features: torch.Tensor) -> torch.Tensor:
            return self.linear(features[0][: int(features[0].sum() > 0) + 1])

    with pytest.raises(ExportError, match="Untraceable\\): ONNX export failed"):
        export_scaled(Untraceable(), tmp_path / "a.onnx")
    assert entries(cache) == []
