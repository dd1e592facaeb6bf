"""A damaged export is refused with an error naming the file and key: truncated weights, a missing
slice, edited shapes, unknown versions, dangling edges. Also the ``check`` CLI."""
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

from gr.export import ExportFormatError, check_export, export_model, load_hstu
from gr.export.__main__ import main as export_main
from gr.serving import Ranker
from test_export_roundtrip import DENSE_DIMS, build_ranking_model


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return export_model(build_ranking_model(), tmp_path_factory.mktemp("pristine") / "export", dense_dims=DENSE_DIMS)


@pytest.fixture
def export(pristine, tmp_path):
    """A fresh copy of a valid export to damage."""
    copy = tmp_path / "export"
    shutil.copytree(pristine, copy)
    assert check_export(copy) == []
    return copy


def problems(path: Path):
    return [(p.file, p.key, p.message) for p in check_export(path)]


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def truncate(path: Path, drop: int = 64) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - drop)


def test_truncated_hstu_weights_are_an_error_for_the_checker_and_every_loader(export):
    truncate(export / "hstu/model.safetensors")
    found = problems(export)
    assert [(f, k) for f, k, _ in found] == [("hstu/model.safetensors", "-")]
    assert "truncated" in found[0][2]
    with pytest.raises(ExportFormatError, match=r"hstu/model.safetensors \[-\]: not a readable safetensors"):
        load_hstu(export)
    with pytest.raises(ExportFormatError, match="hstu/model.safetensors"):
        Ranker.load(export)


def test_truncated_embedding_table_is_an_error(export):
    truncate(export / "sparse/item.safetensors", drop=8)
    assert [(f, k) for f, k, _ in problems(export)] == [("sparse/item.safetensors", "-")]


def test_missing_slice_is_an_error(export):
    shutil.rmtree(export / "prefix_dnn")
    assert ("prefix_dnn/model.onnx", "-", "file is missing (slice prefix_dnn)") in problems(export)
    with pytest.raises(ExportFormatError, match="prefix_dnn/model.onnx"):
        Ranker.load(export)


def test_missing_or_misshaped_hstu_tensors_are_named(export):
    path = export / "hstu/model.safetensors"
    tensors = load_file(str(path))
    del tensors["layers.1.time_bias"]
    tensors["layers.0.uvqk.bias"] = tensors["layers.0.uvqk.bias"][:-1]
    save_file(tensors, str(path))
    found = {(f, k): m for f, k, m in problems(export)}
    assert "tensor is missing" in found[("hstu/model.safetensors", "layers.1.time_bias")]
    assert "shape [63], config.ini implies [64]" in found[("hstu/model.safetensors", "layers.0.uvqk.bias")]


def test_edited_shape_in_the_slice_graph_is_an_error(export):
    edit(export / "default/slice_graph.ini", "[slice.prefix_dnn.input.genre]\ndtype = float32\nshape = tokens, 4",
         "[slice.prefix_dnn.input.genre]\ndtype = float32\nshape = tokens, 5")
    found = {(f, k): m for f, k, m in problems(export)}
    assert "sparse.genre has shape ['tokens', 4], the input expects ['tokens', 5]" in \
        found[("default/slice_graph.ini", "slice.prefix_dnn.input.genre.source")]
    assert "shape ['tokens', 4]" in found[("prefix_dnn/model.onnx", "genre")]


def test_edited_hidden_dim_in_config_ini_is_an_error(export):
    edit(export / "hstu/config.ini", "hidden_dim = 16", "hidden_dim = 32")
    found = {(f, k) for f, k, _ in problems(export)}
    assert ("hstu/model.safetensors", "layers.0.uvqk.weight") in found
    assert ("default/slice_graph.ini", "slice.hstu.input.x.shape") in found


def test_bad_config_values_are_named_by_key(export):
    edit(export / "hstu/config.ini", "num_layers = 2", "num_layers = two")
    edit(export / "hstu/config.ini", "model_type = hstu", "model_type = bert")
    found = {(f, k): m for f, k, m in problems(export)}
    assert found[("hstu/config.ini", "model.num_layers")] == "expected an integer, got 'two'"
    assert "expected 'hstu'" in found[("hstu/config.ini", "model.model_type")]


def test_a_missing_field_is_an_error_unless_it_came_after_format_1(export):
    edit(export / "hstu/config.ini", "query_time = token\n", "")
    assert problems(export) == [] and load_hstu(export).config.query_time == "token"  # older exports still load
    edit(export / "hstu/config.ini", "num_heads = 2\n", "")
    assert ("hstu/config.ini", "model.num_heads", "missing HSTUConfig field") in problems(export)


@pytest.mark.parametrize("file", ["default/slice_graph.ini", "sparse/sparse.ini", "hstu/config.ini"])
def test_unknown_format_version_is_an_error(export, file):
    edit(export / file, "version = 1", "version = 7")
    assert (file, "format.version", "unknown format version '7'; this reader knows 1") in problems(export)


def test_dangling_graph_edge_is_an_error(export):
    edit(export / "default/slice_graph.ini", "source = hstu.hidden", "source = hstu.last_hidden")
    edit(export / "default/slice_graph.ini", "source = prefix_dnn.embedding", "source = postfix_dnn.click")
    keys = {k: m for f, k, m in problems(export) if f == "default/slice_graph.ini"}
    assert keys["slice.postfix_dnn.input.hidden.source"].startswith("dangling edge: 'hstu.last_hidden'")
    assert keys["slice.hstu.input.x.source"].startswith("dangling edge: 'postfix_dnn.click'"), \
        "edges only point upstream"


def test_check_cli_reports_problems_by_file_and_key(export, capsys):
    assert export_main(["check", str(export)]) == 0
    assert capsys.readouterr().out.strip().endswith(": OK")
    edit(export / "sparse/sparse.ini", "rows = 50", "rows = 60")
    assert export_main(["check", str(export)]) == 1
    out = capsys.readouterr().out
    assert "ERROR sparse/item.safetensors [weight]: shape [50, 16], sparse.ini says [60, 16]" in out
    assert out.strip().endswith("1 problem(s)")
