"""gr's fused CPU kernels (gr.ops.native): built once per process (whatever its threads do), in a directory
named by what the binary depends on, switchable by GR_CPU_FUSED, and a failed build falls back with the
reason logged (or fails loudly when required)."""

import logging
import os
import threading
import time

import pytest
import torch
from torch.utils import cpp_extension

import gr.hstu.kernels  # noqa: F401 (adds HSTU's kernels to the build, as importing gr.hstu does)
from gr.ops import native
from gr.ops.native import fused_setting, native_ops
from helpers.native import X86


def test_the_setting_is_validated(monkeypatch):
    monkeypatch.setenv("GR_CPU_FUSED", "yes")
    with pytest.raises(ValueError, match="GR_CPU_FUSED: expected 'auto', '0' or '1', got 'yes'"):
        fused_setting()
    monkeypatch.setenv("GR_CPU_FUSED", "0")
    assert native_ops("gr_cpu_fused") is None and native_ops("gr_cpu_loss") is None


@pytest.mark.skipif(not X86, reason="the fused kernels are built for x86-64 only")
def test_all_op_namespaces_come_from_one_build(monkeypatch):
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    attention, loss = native_ops("gr_cpu_fused"), native_ops("gr_cpu_loss")
    layer, random = native_ops("gr_cpu_layer"), native_ops("gr_cpu_random")
    gemm = native_ops("gr_cpu_gemm")
    assert hasattr(attention, "forward_chunks") and hasattr(loss, "sampled_softmax_forward")
    assert hasattr(layer, "projection_forward") and hasattr(layer, "norm_forward")
    assert hasattr(random, "keep_mask") and hasattr(random, "randint")
    assert hasattr(gemm, "gemm") and hasattr(gemm, "transpose")
    assert native._load.cache_info().misses == 1


def test_a_broken_source_fails_to_build_with_the_compiler_error(tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="Error building extension"):
        native.build("gr_test_broken_source", [broken], tmp_path / "extensions")


def test_checkouts_of_one_version_share_one_build_and_a_changed_source_is_copied_again(tmp_path):
    """ninja rebuilds when a source's path changes: the build compiles copies kept in its directory."""
    checkouts = [tmp_path / "a", tmp_path / "b"]
    for checkout in checkouts:
        checkout.mkdir()
        (checkout / "tiny.cpp").write_text("int gr_tiny() { return 1; }\n")
    library = tmp_path / "extensions" / "gr_test_shared_build" / "gr_test_shared_build.so"
    native.build("gr_test_shared_build", [checkouts[0] / "tiny.cpp"], tmp_path / "extensions")
    built = library.stat().st_mtime_ns
    native.build("gr_test_shared_build", [checkouts[1] / "tiny.cpp"], tmp_path / "extensions")
    assert library.stat().st_mtime_ns == built
    staged = library.parent / "src" / "tiny.cpp"
    assert staged.read_text() == (checkouts[0] / "tiny.cpp").read_text()
    assert {p.name for p in (library.parent / "include").iterdir()} == {h.name for h in native.HEADERS.glob("*.h")}
    (checkouts[1] / "tiny.cpp").write_text("int gr_tiny() { return 2; }\n")
    native.build("gr_test_shared_build", [checkouts[1] / "tiny.cpp"], tmp_path / "extensions")
    assert "return 2" in staged.read_text()


def test_the_build_runs_the_environments_ninja_whatever_is_first_on_path(tmp_path, monkeypatch):
    """Another ninja first on PATH (a system one) would read the build log as changed commands and
    recompile everything: the build runs the ``ninja`` package's, and PATH is left as it was."""
    other = tmp_path / "other-bin"
    other.mkdir()
    called = tmp_path / "other ninja ran"
    (other / "ninja").write_text(f"#!/bin/sh\ntouch '{called}'\nexit 1\n")
    (other / "ninja").chmod(0o755)
    path = os.pathsep.join([str(other), os.environ.get("PATH", "")])
    monkeypatch.setenv("PATH", path)
    (tmp_path / "tiny.cpp").write_text("int gr_tiny() { return 1; }\n")
    native.build("gr_test_own_ninja", [tmp_path / "tiny.cpp"], tmp_path / "extensions")
    assert (tmp_path / "extensions" / "gr_test_own_ninja" / "gr_test_own_ninja.so").is_file()
    assert not called.exists() and os.environ["PATH"] == path


def test_a_failed_build_falls_back_with_the_reason_logged_or_fails_when_required(monkeypatch, caplog):
    def failing_build(name, sources, directory):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(native, "build", failing_build)
    with caplog.at_level(logging.WARNING, logger="gr.ops.native"):
        assert native._load.__wrapped__(tuple(native.SOURCES)) == (False, "no C++ compiler found")  # uncached
    assert "no C++ compiler found); running the PyTorch ones" in caplog.text
    monkeypatch.setattr(native, "_load_once", lambda: (False, "no C++ compiler found"))
    monkeypatch.setattr(native.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("GR_CPU_FUSED", "auto")
    assert native_ops("gr_cpu_fused") is None
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    with pytest.raises(RuntimeError, match="GR_CPU_FUSED=1 but gr's fused CPU kernels did not build: no C"):
        native_ops("gr_cpu_loss")


@pytest.mark.skipif(not X86, reason="the fused kernels are built for x86-64 only")
def test_loading_the_kernels_keeps_subnormal_floats(monkeypatch):
    """They are compiled with -ffast-math but not linked with it: crtfastmath would set flush-to-zero for
    the whole process and silently zero every subnormal float from then on."""
    monkeypatch.setenv("GR_CPU_FUSED", "1")
    assert native_ops("gr_cpu_fused") is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert float(tiny * 1.0) > 0.0


def test_a_first_build_says_so_and_a_cached_one_is_silent(monkeypatch, tmp_path, capsys):
    """Compiling takes a minute or so at the first training step: the console says why the step waits."""
    built = []
    monkeypatch.setattr(native, "build", lambda name, sources, directory: built.append(directory / name))
    monkeypatch.setenv("GR_EXTENSIONS_DIR", str(tmp_path))
    assert native._load.__wrapped__(tuple(native.SOURCES)) == (True, "")  # uncached
    assert f"compiling gr's fused CPU kernels for this CPU, once (~1 min): {built[0]}" in capsys.readouterr().err
    library = built[0] / f"{built[0].name}.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    native._load.__wrapped__(tuple(native.SOURCES))
    assert "compiling" not in capsys.readouterr().err


@pytest.mark.skipif(not X86, reason="the fused kernels are built for x86-64 only")
def test_gradients_of_the_fused_kernels_repeat_bitwise_on_more_threads(monkeypatch):
    """Per-thread partial sums (bias, weight and item-table gradients) are added up in thread order,
    so a result does not depend on which thread finished first: on 4 threads (an order-dependent
    merge shows up from 3) every gradient of an HSTU step and of the sampled softmax is the same
    in 5 repeats (the softmax with negatives per row and shared by blocks of 10 rows)."""
    from gr.hstu import HSTU, HSTUConfig
    from gr.ops.sampled_softmax import sampled_softmax_loss

    monkeypatch.setenv("GR_CPU_FUSED", "1")
    config = HSTUConfig(hidden_dim=32, num_layers=2, num_heads=2, attention_dim=8, linear_dim=16, max_seq_len=256)
    torch.manual_seed(0)
    stack = HSTU(config).train()
    lengths = torch.tensor([250, 3, 120, 77, 200, 31, 180, 139])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    x = torch.randn(int(offsets[-1]), 32)
    timestamps = torch.arange(int(offsets[-1])) * 60
    queries, items = torch.randn(1000, 16, requires_grad=True), torch.randn(300, 16, requires_grad=True)
    positives, negatives = torch.randint(0, 300, (1000,)), torch.randint(0, 300, (1000, 40))

    def gradients():
        torch.manual_seed(1)  # the same dropout masks
        stack.zero_grad()
        stack(x, offsets, 256, timestamps).square().sum().backward()
        loss = sampled_softmax_loss(queries, items, positives, negatives, 0.05)
        loss = loss + sampled_softmax_loss(queries, items, positives, negatives[:100], 0.05, rows_per_draw=10)
        return [p.grad.clone() for p in stack.parameters()] + list(torch.autograd.grad(loss, (queries, items)))

    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        first = gradients()
        names = [n for n, _ in stack.named_parameters()] + ["queries", "items"]
        for _ in range(4):
            assert [n for n, a, b in zip(names, first, gradients()) if not torch.equal(a, b)] == []
    finally:
        torch.set_num_threads(threads)


def test_concurrent_first_uses_build_and_load_once(monkeypatch, tmp_path):
    """Two request threads asking for the kernels at once used to build (and register the op
    namespaces) twice, which aborts the process."""
    calls = []

    def slow_build(name, sources, directory):
        calls.append(name)
        time.sleep(0.3)

    monkeypatch.setattr(native, "build", slow_build)
    monkeypatch.setenv("GR_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", [])
    native._load.cache_clear()
    try:
        results = []
        threads = [threading.Thread(target=lambda: results.append(native._load_once())) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        native._load.cache_clear()  # the next caller loads the real (already loaded) library again
    assert len(calls) == 1 and results == [(True, "")] * 4


def test_sources_added_after_the_library_loaded_build_a_library_of_their_own(monkeypatch, tmp_path):
    """A package above gr.ops adds its kernels' sources as it is imported: one imported after the first op
    was asked for gets a library of its own (building the loaded one again would register its namespaces
    twice), and a source added twice is built once."""
    built = []
    monkeypatch.setattr(native, "build", lambda name, sources, directory: built.append(sources))
    monkeypatch.setenv("GR_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native, "SOURCES", list(native.SOURCES))
    monkeypatch.setattr(native, "_libraries", [])
    monkeypatch.setattr(native, "_loaded", [])
    late = tmp_path / "late.cpp"
    late.write_text("int gr_late() { return 1; }\n")
    first = list(native.SOURCES)
    native._load.cache_clear()
    try:
        assert native._load_once() == (True, "")
        native.add_sources([late])
        native.add_sources([late])
        assert native._load_once() == native._load_once() == (True, "")
    finally:
        native._load.cache_clear()  # the next caller loads the real (already loaded) library again
    assert built == [first, [late]]


def test_the_library_name_hashes_sources_flags_torch_and_its_install_and_a_build_changes_no_flag(monkeypatch, tmp_path):
    name = native.library_name(native.SOURCES)
    assert name.startswith("gr_cpu_native_") and native.library_name(native.SOURCES) == name
    monkeypatch.setattr(native, "LDFLAGS", (*native.LDFLAGS, "-lm"))
    assert native.library_name(native.SOURCES) != name
    monkeypatch.setattr(native.torch, "__version__", "0.0.0")
    monkeypatch.setattr(native, "LDFLAGS", native.LDFLAGS[:-1])
    assert native.library_name(native.SOURCES) != name
    monkeypatch.undo()
    monkeypatch.setattr(native.torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert native.library_name(native.SOURCES) != name
    monkeypatch.undo()
    spelled = [f"{path}/." for path in cpp_extension.include_paths()]
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *args, **kwargs: spelled)
    assert native.library_name(native.SOURCES) != name  # the same torch reached by another path: a build of its own
    monkeypatch.undo()
    before = (native.CFLAGS, native.LDFLAGS)

    def appending_load(*, extra_cflags, extra_ldflags, **_):  # torch's load() extends its lists in place
        extra_cflags.append("-fPIC")
        extra_ldflags.append("-shared")

    monkeypatch.setattr(cpp_extension, "load", appending_load)
    native.build("gr_test_flags_unchanged", [], tmp_path / "extensions")
    native.build("gr_test_flags_unchanged", [], tmp_path / "extensions")
    assert (native.CFLAGS, native.LDFLAGS) == before


def test_a_build_killed_while_it_held_the_lock_leaves_nothing_that_stops_the_next(tmp_path):
    """A process killed mid-build (here: one that exits holding the lock) leaves torch's lock file
    behind: the next build takes the lock at once and removes that file."""
    pid = os.fork()
    if pid == 0:  # the killed build: takes the lock, writes torch's file, dies without a word
        with native.build_lock(tmp_path):
            (tmp_path / "lock").write_text("")
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0 and (tmp_path / "lock").exists()
    start = time.monotonic()
    with native.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert time.monotonic() - start < 5


def test_a_second_build_waits_for_the_first_to_release_the_lock(tmp_path):
    order = []

    def second():
        with native.build_lock(tmp_path):
            order.append("second")

    with native.build_lock(tmp_path):
        thread = threading.Thread(target=second)
        thread.start()
        thread.join(0.5)
        order.append("first")
    thread.join(5)
    assert order == ["first", "second"]
