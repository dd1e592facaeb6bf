"""A damaged export is refused with an error naming the file and key. Any edit after export is
caught by the MANIFEST; the other checks are shown on exports damaged *and re-signed* (a consistent
but wrong export): truncated weights, a missing slice, edited shapes, unknown versions, dangling
edges, paths that leave the export, non-finite weights, id maps that repeat a raw id or pass their
table. Also the ``check`` CLI."""

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from gr.commands.export import main as export_main
from gr.data.mappings import IdMap, save_mappings
from gr.export import ExportFormatError, check_export, export_model, load_hstu
from gr.export.manifest import write_manifest
from gr.serving import Ranker
from helpers.models import DENSE_DIMS, build_ranking_model, build_retrieval_model


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


def root_of(path: Path) -> Path:
    return next(p for p in path.parents if (p / "MANIFEST").exists())


def edit(path: Path, old: str, new: str, sign: bool = True) -> None:
    """Replace text in one file of an export; ``sign`` rewrites the MANIFEST to match."""
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))
    if sign:
        write_manifest(root_of(path))


def edit_config(export: Path, **changes) -> None:
    path = export / "hstu/config.json"
    values = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            del values[key]
        else:
            values[key] = value
    path.write_text(json.dumps(values))
    write_manifest(export)


def truncate(path: Path, drop: int = 64) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - drop)
    write_manifest(root_of(path))


def test_any_edit_after_export_is_a_manifest_error_for_the_checker_and_every_loader(export):
    edit_config_unsigned = export / "hstu/config.json"
    values = json.loads(edit_config_unsigned.read_text())
    values["time_bucketing"] = "sqrt"  # would change scores silently
    edit_config_unsigned.write_text(json.dumps(values))
    assert problems(export) == [
        ("hstu/config.json", "-", "sha256 differs from MANIFEST: the file was changed after export")
    ]
    for load in (load_hstu, Ranker.load):
        with pytest.raises(ExportFormatError, match="hstu/config.json .*sha256 differs from MANIFEST"):
            load(export)


def test_added_missing_and_linked_files_are_manifest_errors(export, tmp_path):
    (export / "hstu/extra.bin").write_bytes(b"x")
    (export / "sparse/user.safetensors").unlink()
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    os.symlink(outside, export / "prefix_dnn/link.txt")
    found = {(f, m.split(":")[0]) for f, _, m in problems(export)}
    assert ("hstu/extra.bin", "file is not in MANIFEST") in found
    assert ("sparse/user.safetensors", "file is missing (MANIFEST lists it)") in found
    assert ("prefix_dnn/link.txt", "a symbolic link") in found


@pytest.mark.parametrize("outside", ["copy", "/etc/passwd"])
def test_a_linked_manifest_is_refused_by_name_without_reading_it(export, tmp_path, outside):
    target = tmp_path / "MANIFEST.copy" if outside == "copy" else Path(outside)
    if outside == "copy":
        shutil.copy(export / "MANIFEST", target)
    (export / "MANIFEST").unlink()
    os.symlink(target, export / "MANIFEST")
    assert problems(export) == [("MANIFEST", "-", "a symbolic link: an export holds plain files only")]
    with pytest.raises(ExportFormatError, match=r"MANIFEST \[-\]: a symbolic link"):
        Ranker.load(export)


def test_missing_manifest_or_a_format_1_export_is_refused_with_what_to_do(export):
    (export / "MANIFEST").unlink()
    assert problems(export)[0][:2] == ("MANIFEST", "-") and "re-export" in problems(export)[0][2]
    (export / "hstu/config.json").rename(export / "hstu/config.ini")
    write_manifest(export)
    assert (
        "hstu/config.json",
        "-",
        "file is missing (this is a format-1 export with hstu/config.ini: re-export the run with this version of gr)",
    ) in problems(export)


def test_paths_in_an_ini_that_leave_the_export_are_refused_before_reading(export):
    edit(export / "sparse/sparse.ini", "file = item.safetensors", "file = ../../item.safetensors")
    edit(export / "sparse/sparse.ini", "[feature.user_id]\n", "[feature.user_id]\nid_mapping = /etc/passwd\n")
    found = {(f, k): m for f, k, m in problems(export)}
    assert "leaves the export directory" in found[("sparse/sparse.ini", "table.item.file")]
    assert "leaves the export directory" in found[("sparse/sparse.ini", "feature.user_id.id_mapping")]


def test_non_finite_weights_are_refused(export):
    path = export / "hstu/model.safetensors"
    tensors = load_file(str(path))
    tensors["layers.0.o_proj.bias"][0] = np.nan
    save_file(tensors, str(path))
    write_manifest(export)
    assert ("hstu/model.safetensors", "layers.0.o_proj.bias", "holds NaN or infinite values") in problems(export)


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
    write_manifest(export)
    assert ("prefix_dnn/model.onnx", "-", "file is missing (slice prefix_dnn)") in problems(export)
    with pytest.raises(ExportFormatError, match="prefix_dnn/model.onnx"):
        Ranker.load(export)


def test_missing_or_misshaped_hstu_tensors_are_named(export):
    path = export / "hstu/model.safetensors"
    tensors = load_file(str(path))
    del tensors["layers.1.relative_time_bias"]
    tensors["layers.0.q_proj.bias"] = tensors["layers.0.q_proj.bias"][:-1]
    save_file(tensors, str(path))
    write_manifest(export)
    found = {(f, k): m for f, k, m in problems(export)}
    assert "tensor is missing" in found[("hstu/model.safetensors", "layers.1.relative_time_bias")]
    assert "shape [15], hstu/config.json implies [16]" in found[("hstu/model.safetensors", "layers.0.q_proj.bias")]


def test_edited_shape_in_the_slice_graph_is_an_error(export):
    edit(
        export / "default/slice_graph.ini",
        "[slice.prefix_dnn.input.genre]\ndtype = float32\nshape = tokens, 4",
        "[slice.prefix_dnn.input.genre]\ndtype = float32\nshape = tokens, 5",
    )
    found = {(f, k): m for f, k, m in problems(export)}
    assert (
        "sparse.genre has shape ['tokens', 4], the input expects ['tokens', 5]"
        in found[("default/slice_graph.ini", "slice.prefix_dnn.input.genre.source")]
    )
    assert "shape ['tokens', 4]" in found[("prefix_dnn/model.onnx", "genre")]


def test_edited_hidden_size_in_config_json_is_an_error(export):
    edit_config(export, hidden_size=32)
    found = {(f, k) for f, k, _ in problems(export)}
    assert ("hstu/model.safetensors", "layers.0.q_proj.weight") in found
    assert ("default/slice_graph.ini", "slice.hstu.input.x.shape") in found


def test_bad_config_values_are_named_by_key(export):
    edit_config(export, model_type="bert", num_hidden_layers="two", alpha=3.0, rogue=1, num_attention_heads=None)
    found = {(f, k): m for f, k, m in problems(export)}
    assert "expected 'hstu'" in found[("hstu/config.json", "model_type")]
    assert found[("hstu/config.json", "rogue")] == "unknown key"
    assert found[("hstu/config.json", "num_attention_heads")] == "missing key"
    edit_config(export, model_type="hstu", rogue=None, num_attention_heads=2)
    assert "hstu/config.json.num_layers: expected an int >= 1, got 'two'" in found_messages(
        export, ("hstu/config.json", "-")
    )
    edit_config(export, num_hidden_layers=2)
    assert (
        "derived from the other keys"
        in dict(((f, k), m) for f, k, m in problems(export))[("hstu/config.json", "alpha")]
    )


def found_messages(export, where):
    return " ".join(m for f, k, m in problems(export) if (f, k) == where)


@pytest.mark.parametrize("file", ["default/slice_graph.ini", "sparse/sparse.ini"])
def test_unknown_format_version_is_an_error(export, file):
    edit(export / file, "version = 2", "version = 7")
    assert (file, "format.version", "unknown format version '7'; this reader knows 2") in problems(export)


def test_dangling_graph_edge_is_an_error(export):
    edit(export / "default/slice_graph.ini", "source = hstu.hidden", "source = hstu.last_hidden")
    edit(export / "default/slice_graph.ini", "source = prefix_dnn.embedding", "source = postfix_dnn.click")
    keys = {k: m for f, k, m in problems(export) if f == "default/slice_graph.ini"}
    assert keys["slice.postfix_dnn.input.hidden.source"].startswith("dangling edge: 'hstu.last_hidden'")
    assert keys["slice.hstu.input.x.source"].startswith("dangling edge: 'postfix_dnn.click'"), (
        "edges only point upstream"
    )


def test_check_cli_reports_problems_by_file_and_key(export, capsys):
    assert export_main(["check", str(export)]) == 0
    assert capsys.readouterr().out.strip().endswith(": OK")
    edit(export / "sparse/sparse.ini", "rows = 50", "rows = 60")
    assert export_main(["check", str(export)]) == 1
    out = capsys.readouterr().out
    assert "ERROR sparse/item.safetensors [weight]: shape [50, 16], sparse.ini says [60, 16]" in out
    assert out.strip().endswith("1 problem(s)")


def test_stale_temporaries_of_a_killed_export_are_named_by_check_and_removed_by_the_next_export(
    pristine, tmp_path, capsys
):
    """An export writes into ``.NAME.tmp-*`` beside NAME under ``fcntl.flock``: one whose lock no live
    process holds (its writer was killed) is stale; one a live process holds is left alone."""
    target = tmp_path / "export"
    shutil.copytree(pristine, target)
    stale, live, other = tmp_path / ".export.tmp-0badc0de", tmp_path / ".export.tmp-11ve", tmp_path / ".other.tmp-1"
    for directory in (stale, live, other):
        (directory / "hstu").mkdir(parents=True)
        (directory / "hstu/model.safetensors").write_bytes(b"partial")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print(flush=True); time.sleep(120)",
            str(live),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        holder.stdout.readline()  # the live export holds its directory
        assert export_main(["check", str(target)]) == 0
        out = capsys.readouterr().out
        assert f"WARNING {stale}: a temporary directory left by an interrupted export" in out
        assert str(live) not in out and str(other) not in out and out.strip().endswith(": OK")
        export_model(build_ranking_model(), target, dense_dims=DENSE_DIMS, overwrite=True)
        assert not stale.exists() and live.exists() and other.exists()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".export.")] == [live.name]
    finally:
        holder.kill()
        holder.wait()
    fd = os.open(live, os.O_RDONLY)  # killed: its lock went with it
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)
    assert export_main(["check", str(target)]) == 0
    assert f"WARNING {live}: " in capsys.readouterr().out


RAW_ITEMS = [f"m{i:02d}" for i in range(50)]


@pytest.fixture(scope="module")
def mapped_pristine(tmp_path_factory):
    """A retrieval export whose item ids are raw strings, through sparse/id_maps/items.tsv."""
    root = tmp_path_factory.mktemp("mapped")
    save_mappings(str(root / "maps"), {"items": IdMap.of(np.array(RAW_ITEMS))}, {})
    return export_model(build_retrieval_model(), root / "export", id_mappings_dir=root / "maps")


@pytest.mark.parametrize(
    "old, new, where, message",
    [
        (
            "5\tm05\n",
            "5\tm04\n",
            ("sparse/id_maps", "-"),
            "sparse/id_maps/items.tsv:7: raw_id 'm04' repeats line 6 (each raw id maps to one dense id)",
        ),
        ("49\tm49\n", "49\tm49\n50\tm50\n", ("sparse/sparse.ini", "feature.item_id.id_mapping"), "rows up to 50"),
        ("5\tm05\n", "6\tm05\n", ("sparse/id_maps", "-"), "items.tsv:7: expected dense_id 5<TAB>raw_id"),
    ],
)
def test_an_id_map_that_cannot_serve_is_refused_by_check_and_every_loader(
    mapped_pristine, tmp_path, old, new, where, message
):
    export = tmp_path / "export"
    shutil.copytree(mapped_pristine, export)
    assert check_export(export) == []
    edit(export / "sparse/id_maps/items.tsv", old, new)
    assert message in found_messages(export, where)
    with pytest.raises(ExportFormatError, match=re.escape(message)):
        Ranker.load(export)
