"""``gr data download``: checksums, truncation, safe unpacking and count checks, against a
local HTTP server on 127.0.0.1 serving archives the tests build (no test reaches the internet)."""

from __future__ import annotations

import dataclasses
import hashlib
import http.server
import json
import stat
import subprocess
import sys
import threading
import zipfile
from functools import partial
from pathlib import Path

import pytest

from gr.commands import data as data_command
from gr.data import download as dl

ROOT = Path(__file__).resolve().parents[1]
RATINGS = [(u, i, 1 + (u + i) % 5, 880_000_000 + 10 * u + i) for u in range(1, 6) for i in range(1, 8) if (u + i) % 3]
ITEMS = len({i for _, i, _, _ in RATINGS})


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the test's directory; ``/truncated/NAME`` announces NAME's full size but sends half."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if not self.path.startswith("/truncated/"):
            return super().do_GET()
        body = (Path(self.directory) / self.path.removeprefix("/truncated/")).read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2])
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def served(tmp_path):
    """(directory served, base URL)."""
    root = tmp_path / "served"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _ml_100k_zip(path: Path, extra: tuple = ()) -> Path:
    """A MovieLens-100K-format zip (``ml-100k/u.data`` + README) plus ``extra`` (ZipInfo, bytes) members."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("ml-100k/README", "fixture\n")
        zf.writestr("ml-100k/u.data", "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in RATINGS))
        for info, data in extra:
            zf.writestr(info, data)
    return path


def _source(path: Path, url: str, **changes) -> dict:
    digest = hashlib.md5(path.read_bytes()).hexdigest()
    fields = dict(url=url, md5=digest, interactions=len(RATINGS), items=ITEMS)
    return {"ml-100k": dataclasses.replace(dl.DATASETS["ml-100k"], **{**fields, **changes})}


def test_download_verifies_unpacks_into_dir_and_checks_counts(served, tmp_path):
    root, base = served
    archive = _ml_100k_zip(root / "ml-100k.zip")
    target = tmp_path / "data" / "ml-100k"
    record = dl.download_dataset("ml-100k", target, progress=False, sources=_source(archive, f"{base}/ml-100k.zip"))
    assert sorted(p.name for p in target.iterdir()) == ["DOWNLOAD.json", "README", "u.data"]
    assert record["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert json.loads((target / "DOWNLOAD.json").read_text()) == record
    assert (record["interactions"], record["items"]) == (len(RATINGS), ITEMS)


def test_gr_data_download_reads_and_checks_a_dataset_without_importing_torch(served, tmp_path):
    root, base = served
    archive = _ml_100k_zip(root / "ml-100k.zip")
    published = _source(archive, f"{base}/ml-100k.zip")["ml-100k"]
    target = tmp_path / "ml-100k"
    code = f"""
import dataclasses, sys
from gr.data import download
download.DATASETS["ml-100k"] = dataclasses.replace(
    download.DATASETS["ml-100k"], md5={published.md5!r}, interactions={published.interactions}, items={ITEMS}
)
from gr.commands import cli
status = cli.main(["data", "download", "ml-100k", {str(target)!r}, "--url", {published.url!r}, "--no-progress"])
print(status, "torch" in sys.modules)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert run.stdout.splitlines()[-1] == "0 False", run.stderr[-2000:]
    assert (target / "u.data").is_file() and json.loads((target / "DOWNLOAD.json").read_text())["items"] == ITEMS


def test_overwrite_says_it_deletes_dir_old_before_it_does(served, tmp_path, caplog):
    root, base = served
    archive = _ml_100k_zip(root / "ml-100k.zip")
    target, old = tmp_path / "ml-100k", tmp_path / "ml-100k.old"
    for directory in (target, old):
        directory.mkdir()
        (directory / "mine.txt").write_text("kept?")
    deleted_when_said = []
    caplog.set_level("WARNING")
    caplog.handler.addFilter(lambda record: deleted_when_said.append(not old.exists()) or True)
    dl.download_dataset(
        "ml-100k", target, overwrite=True, progress=False, sources=_source(archive, f"{base}/ml-100k.zip")
    )
    assert f"--overwrite: {old} exists and will be deleted" in caplog.text
    assert deleted_when_said == [False] and not old.exists() and not (target / "mine.txt").exists()


def test_wrong_md5_from_the_cli_is_a_checksum_mismatch_and_creates_nothing(served, tmp_path, capsys):
    root, base = served
    _ml_100k_zip(root / "ml-100k.zip")  # not the published archive: its md5 differs from GroupLens's
    target = tmp_path / "ml-100k"
    code = data_command.main(["ml-100k", str(target), "--url", f"{base}/ml-100k.zip", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "ChecksumMismatch" in err and dl.DATASETS["ml-100k"].md5 in err
    assert not target.exists() and list(tmp_path.iterdir()) == [root]


def test_a_failed_download_removes_the_parent_directories_it_created_and_only_those(served, tmp_path):
    root, base = served
    archive = _ml_100k_zip(root / "ml-100k.zip")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "mine.txt").write_text("kept")
    with pytest.raises(dl.ChecksumMismatch):
        dl.download_dataset(
            "ml-100k",
            tmp_path / "a" / "b" / "c" / "ml-100k",
            sha256="0" * 64,
            progress=False,
            sources=_source(archive, f"{base}/ml-100k.zip"),
        )
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["mine.txt"]


@pytest.mark.parametrize("where", ["under a file", "/proc"])
def test_an_unwritable_target_is_one_line_naming_it_with_exit_status_2(tmp_path, capsys, where):
    if where == "/proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc on this host")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    target = blocker / "sub" / "ml-100k" if where == "under a file" else Path("/proc/dl")
    # a closed local port: nothing reaches the network even if the target were writable
    code = data_command.main(["ml-100k", str(target), "--url", "http://127.0.0.1:9/ml-100k.zip", "--no-progress"])
    [line] = capsys.readouterr().err.strip().splitlines()
    reason = "NotADirectoryError" if where == "under a file" else "FileNotFoundError"
    assert code == 2 and line.startswith(f"gr data download: error: {reason}: {target}: cannot write there (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize(
    "target, what", [(".", "is the working directory"), ("..", "is a parent of the working directory")]
)
def test_a_target_that_is_the_working_directory_is_one_line_saying_what_is_expected(
    tmp_path, capsys, monkeypatch, target, what
):
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    code = data_command.main(["ml-100k", target, "--url", "http://127.0.0.1:9/ml-100k.zip", "--no-progress"])
    assert code == 2 and capsys.readouterr().err == (
        f"gr data download: error: ValueError: DIR {target}: {what} ({tmp_path / 'here'}); name a new directory "
        "to write, e.g. one inside it\n"
    )
    assert list(tmp_path.iterdir()) == [tmp_path / "here"] and list((tmp_path / "here").iterdir()) == []


def test_a_target_spelled_with_dot_dot_is_written_where_it_leads(served, tmp_path, monkeypatch, capsys):
    root, base = served
    archive = _ml_100k_zip(root / "ml-100k.zip")
    monkeypatch.setitem(dl.DATASETS, "ml-100k", _source(archive, f"{base}/ml-100k.zip")["ml-100k"])
    monkeypatch.chdir(tmp_path)
    assert data_command.main(["ml-100k", "data/ml-100k/..", "--no-progress"]) == 0
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["DOWNLOAD.json", "README", "u.data"]


def test_wrong_sha256_option_is_a_checksum_mismatch(served, tmp_path):
    root, base = served
    archive = _ml_100k_zip(root / "ml-100k.zip")
    with pytest.raises(dl.ChecksumMismatch, match=r"--sha256"):
        dl.download_dataset(
            "ml-100k",
            tmp_path / "out",
            sha256="0" * 64,
            progress=False,
            sources=_source(archive, f"{base}/ml-100k.zip"),
        )


def test_truncated_download_is_named(served, tmp_path):
    root, base = served
    archive = _ml_100k_zip(root / "ml-100k.zip")
    with pytest.raises(dl.TruncatedDownload, match="short|announced"):
        dl.download_dataset(
            "ml-100k", tmp_path / "out", progress=False, sources=_source(archive, f"{base}/truncated/ml-100k.zip")
        )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["ml-100k/../../escaped.txt", "/tmp/escaped.txt", "ml-100k/a/../../../escaped.txt"])
def test_archive_member_escaping_the_target_is_refused(served, tmp_path, name):
    root, base = served
    archive = _ml_100k_zip(root / "ml-100k.zip", extra=((zipfile.ZipInfo(name), b"x"),))
    with pytest.raises(dl.UnsafeArchive, match="outside the target"):
        dl.download_dataset(
            "ml-100k", tmp_path / "a" / "out", progress=False, sources=_source(archive, f"{base}/ml-100k.zip")
        )
    assert not list(tmp_path.rglob("escaped.txt")) and not (tmp_path / "a" / "out").exists()


def test_symlink_member_is_refused(served, tmp_path):
    root, base = served
    link = zipfile.ZipInfo("ml-100k/u.item")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    archive = _ml_100k_zip(root / "ml-100k.zip", extra=((link, "/etc/passwd"),))
    with pytest.raises(dl.UnsafeArchive, match="link or special file"):
        dl.download_dataset(
            "ml-100k", tmp_path / "out", progress=False, sources=_source(archive, f"{base}/ml-100k.zip")
        )


@pytest.mark.parametrize("field,value", [("interactions", len(RATINGS) + 1), ("items", ITEMS - 1)])
def test_wrong_counts_are_a_count_mismatch(served, tmp_path, field, value):
    root, base = served
    archive = _ml_100k_zip(root / "ml-100k.zip")
    with pytest.raises(dl.CountMismatch, match=f"{field}, the published dataset has {value}"):
        dl.download_dataset(
            "ml-100k",
            tmp_path / "out",
            progress=False,
            sources=_source(archive, f"{base}/ml-100k.zip", **{field: value}),
        )
    assert not (tmp_path / "out").exists()


def test_amazon_books_needs_sha256_and_is_saved_as_its_csv(served, tmp_path):
    root, base = served
    csv = root / "ratings_Books.csv"
    csv.write_text("".join(f"A{u},{i:010d},{r}.0,{t}\n" for u, i, r, t in RATINGS))
    sources = {
        "amazon-books": dataclasses.replace(
            dl.DATASETS["amazon-books"], url=f"{base}/ratings_Books.csv", interactions=len(RATINGS)
        )
    }
    with pytest.raises(dl.MissingChecksum, match="--sha256"):
        dl.download_dataset("amazon-books", tmp_path / "books", progress=False, sources=sources)
    digest = hashlib.sha256(csv.read_bytes()).hexdigest()
    record = dl.download_dataset(
        "amazon-books", tmp_path / "books", sha256=digest.upper(), progress=False, sources=sources
    )
    assert (tmp_path / "books" / "ratings_Books.csv").read_bytes() == csv.read_bytes()
    assert record["items"] == ITEMS


def test_every_dataset_documents_its_licence_in_help(capsys):
    with pytest.raises(SystemExit):
        data_command.main(["--help"])
    out = capsys.readouterr().out
    for name, source in dl.DATASETS.items():
        assert name in out and source.url in out
    assert "Harper and J. A. Konstan" in out and "He and J. McAuley" in out
