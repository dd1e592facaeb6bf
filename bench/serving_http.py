"""Serving latency and throughput through the HTTP service against the in-process call.

Each client is a thread with its own user (a history of ``--history`` tokens, cache warm) that
sends ``--requests`` rank requests of ``--candidates`` candidates back to back, either through
``python -m gr.serving serve`` (a real server process, one keep-alive HTTP connection per
client, JSON both ways) or by calling ``Ranker.rank`` in this process. For 1, 8 and 32
concurrent clients it reports p50/p99 latency and requests/s of both. The model is
bench/serving.py's (hidden 256, 4 layers, ranking heads), exported with ``gr.export``.
Target: at one client, HTTP adds at most 10% to the in-process p50.

Run: ``.venv/bin/python bench/serving_http.py`` (the full size: several minutes on 2 cores);
``--smoke`` runs a tiny size to check the script. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
from serving import (  # bench/serving.py: the same model and requests
    build_model,
    request_tokens,
)

from gr.export import export_model
from gr.serving import Ranker

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(export_dir: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gr.serving",
            "serve",
            str(export_dir),
            "--port",
            str(port),
            "--cache-bytes",
            str(2**31),
        ],
        env=env,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/readyz")
            if connection.getresponse().status == 200:
                return server
        except OSError:
            time.sleep(0.25)
    server.terminate()
    raise RuntimeError("the server did not become ready in 120 s")


def run_clients(clients: int, requests: int, call: Callable[[int], None]) -> Dict[str, float]:
    """``clients`` threads, each ``requests`` calls of call(client) after one warm-up call -> stats."""
    latencies: List[float] = []
    lock = threading.Lock()
    ready = threading.Barrier(clients + 1)

    def client(c: int) -> None:
        call(c)  # warm: encodes this client's user's history into the cache
        ready.wait()
        own = []
        for _ in range(requests):
            start = time.perf_counter()
            call(c)
            own.append(time.perf_counter() - start)
        with lock:
            latencies.extend(own)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    ready.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    ms = np.asarray(latencies) * 1e3
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "req_per_s": len(latencies) / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=int, default=1024)
    parser.add_argument("--candidates", type=int, default=512)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=20, help="timed requests per client")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: history 32, 16 candidates, 1 and 2 clients")
    args = parser.parse_args()
    if args.smoke:
        args.history, args.candidates, args.clients, args.requests = 32, 16, [1, 2], 3
    rng = np.random.default_rng(0)
    histories = [request_tokens(rng, args.history, 0) for _ in range(max(args.clients))]
    candidates = {"item_id": rng.integers(0, 3706, args.candidates)}
    request_time = max(int(h["timestamps"][-1]) for h in histories) + 60
    bodies = [
        json.dumps(
            {
                "user_id": f"user{c}",
                "history": {k: v.tolist() for k, v in h.items()},
                "candidates": {k: v.tolist() for k, v in candidates.items()},
                "request_time": request_time,
            }
        )
        for c, h in enumerate(histories)
    ]
    results: Dict[str, Dict[str, Dict[str, float]]] = {"in_process": {}, "http": {}}
    with tempfile.TemporaryDirectory() as tmp:
        export_dir = export_model(build_model(args.history), Path(tmp) / "export")
        ranker = Ranker.load(export_dir, cache_bytes=2**31)

        def in_process(c: int) -> None:
            ranker.rank(f"user{c}", histories[c], candidates, request_time=request_time)

        port = free_port()
        server = start_server(export_dir, port)
        try:
            local = threading.local()

            def over_http(c: int) -> None:
                if not hasattr(local, "connection"):
                    local.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                local.connection.request("POST", "/v1/rank", bodies[c], {"Content-Type": "application/json"})
                response = local.connection.getresponse()
                body = response.read()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {body[:500]!r}")

            for clients in args.clients:
                for mode, call in (("in_process", in_process), ("http", over_http)):
                    stats = run_clients(clients, args.requests, call)
                    results[mode][str(clients)] = stats
                    print(
                        f"{mode:>10} clients {clients:>2}: p50 {stats['p50_ms']:8.2f} ms  p99 "
                        f"{stats['p99_ms']:8.2f} ms  {stats['req_per_s']:7.2f} req/s",
                        flush=True,
                    )
        finally:
            server.terminate()
            server.wait()
    one = str(min(args.clients))
    overhead = results["http"][one]["p50_ms"] / results["in_process"][one]["p50_ms"] - 1
    print(
        json.dumps(
            {
                "history": args.history,
                "candidates": args.candidates,
                "requests_per_client": args.requests,
                "cpu_count": os.cpu_count(),
                **results,
                "http_p50_overhead_at_1_client": overhead,
            }
        )
    )


if __name__ == "__main__":
    main()
