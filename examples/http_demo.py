"""``make demo``'s last step: start ``python -m gr.serving serve EXPORT_DIR`` on a free port, send
one rank, one recommend and one generate over HTTP (the request of
examples/quickstart_request.json, raw ids), print each answer, and stop the server.

Run: ``.venv/bin/python examples/http_demo.py EXPORT_DIR``
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return {"http_status": exc.code, **json.loads(exc.read())}


def main(export_dir: str) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "gr.serving", "serve", export_dir, "--port", str(port)],
        env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    )
    try:
        for _ in range(600):
            if server.poll() is not None:
                return server.returncode or 1
            try:
                urllib.request.urlopen(f"{url}/readyz", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        request = json.loads((HERE / "quickstart_request.json").read_text())
        history_only = {key: value for key, value in request.items() if key != "candidates"}
        for path, body in (
            ("/v1/rank", request),
            ("/v1/recommend", {**history_only, "k": 5}),
            ("/v1/generate", {**history_only, "k": 5}),
        ):
            print(f"POST {path} {json.dumps(body)}\n  -> {json.dumps(post(url + path, body))}")
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: examples/http_demo.py EXPORT_DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
