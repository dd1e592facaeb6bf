"""docs/hstu_slice.md in plain numpy: the HSTU slice's outputs from ``hstu/config.json`` and
``hstu/model.safetensors`` alone.

Imports numpy and the standard library only, never gr or torch (tests/test_hstu_slice_spec.py
checks both that and that the outputs equal ``gr.export.load_hstu``'s). Section numbers below
are the doc's. Dense math runs in float64; time buckets in float32, as the doc specifies.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path, PurePosixPath
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np

CONFIG = "hstu/config.json"
WEIGHTS = "hstu/model.safetensors"
FORMAT_VERSION = 2


def verify_manifest(root: Path, files: Tuple[str, ...] = (CONFIG, WEIGHTS)) -> None:
    """Check ``files`` against ``root/MANIFEST`` (section 1.1); ValueError naming the file otherwise."""
    listed: Dict[str, str] = {}
    for number, line in enumerate((root / "MANIFEST").read_text(encoding="utf8").splitlines(), start=1):
        digest, sep, rel = line.partition("  ")
        pure = PurePosixPath(rel)
        if not sep or len(digest) != 64 or pure.is_absolute() or ".." in pure.parts:
            raise ValueError(f"MANIFEST line {number}: expected '<sha256 hex>  <relative path>', got {line!r}")
        listed[rel] = digest
    for rel in files:
        if rel not in listed:
            raise ValueError(f"MANIFEST: {rel} is not listed")
        if hashlib.sha256((root / rel).read_bytes()).hexdigest() != listed[rel]:
            raise ValueError(f"{rel}: sha256 differs from MANIFEST")


def read_safetensors(path: Path) -> Dict[str, np.ndarray]:
    """{name: float32 array} of a safetensors file of F32 or BF16 tensors (section 1.3)."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    data = raw[8 + size :]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if entry["dtype"] == "F32":
            array = np.frombuffer(data[begin:end], dtype="<f4").astype(np.float32)
        elif entry["dtype"] == "BF16":
            array = (np.frombuffer(data[begin:end], dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"{path.name}: tensor {name}: dtype {entry['dtype']!r}, expected F32 or BF16")
        out[name] = array.reshape(shape)
    return out


def tensor_shapes(config: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
    """The tensor names and shapes section 1.3 prescribes for ``config``."""
    d, h, da, dl = (config[k] for k in ("hidden_size", "num_attention_heads", "attention_dim", "linear_dim"))
    shapes: Dict[str, Tuple[int, ...]] = {}
    if config["position_embedding"]:
        shapes["embed_positions.weight"] = (config["max_position_embeddings"] + 1, d)
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "input_layernorm.bias": (d,),
                p + "attn_layernorm.weight": (h * dl,),
                p + "attn_layernorm.bias": (h * dl,),
                p + "o_proj.weight": (d, h * dl),
                p + "o_proj.bias": (d,),
            }
        )
        for name, rows in (("u_proj", h * dl), ("v_proj", h * dl), ("q_proj", h * da), ("k_proj", h * da)):
            shapes.update({p + name + ".weight": (rows, d), p + name + ".bias": (rows,)})
        if position_buckets(config) > 0:
            shapes[p + "relative_position_bias"] = (position_buckets(config),)
        if config["time_buckets"] > 0:
            shapes[p + "relative_time_bias"] = (config["time_buckets"],)
    return shapes


def position_buckets(config: Dict[str, Any]) -> int:
    """P: ``position_buckets``, null -> max_position_embeddings + 1."""
    p = config["position_buckets"]
    return config["max_position_embeddings"] + 1 if p is None else p


def time_bucket(dt: np.ndarray, bucketing: str, num_buckets: int, log_divisor: float) -> np.ndarray:
    """dt: int64 seconds (any shape) -> bucket in [0, num_buckets) (section 4.3), float32 steps."""
    f = np.maximum(np.abs(dt).astype(np.float32), np.float32(1.0))
    g = np.log(f) / np.float32(log_divisor) if bucketing == "log" else np.sqrt(f)
    return np.minimum(g.astype(np.float32).astype(np.int64), num_buckets - 1)


def evicted_prefix(length: int, max_len: int, block: int) -> int:
    """How many oldest events a history of ``length`` drops to fit ``max_len`` (section 6)."""
    return -(-max(length - max_len, 0) // block) * block


def next_event_query_times(
    timestamps: np.ndarray, seq_offsets: np.ndarray, num_targets: np.ndarray, request_times: np.ndarray
) -> np.ndarray:
    """Section 5, "next_event": timestamps [T] int64, seq_offsets [B+1], num_targets [B],
    request_times [B] int64 -> query_times [T] int64 (history: the next token's time, the last
    history token: its request's time, targets: their own time)."""
    out = np.array(timestamps, dtype=np.int64, copy=True)
    for b in range(len(num_targets)):
        start, end = int(seq_offsets[b]), int(seq_offsets[b + 1])
        hist = end - start - int(num_targets[b])
        if hist:
            out[start : start + hist - 1] = timestamps[start + 1 : start + hist]
            out[start + hist - 1] = request_times[b]
    return out


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * weight + bias


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class HSTUSlice:
    """An export's HSTU slice, read as the doc says; ``forward`` computes its outputs."""

    def __init__(self, config: Dict[str, Any], weights: Dict[str, np.ndarray]) -> None:
        if config.get("model_type") != "hstu" or config.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{CONFIG}: expected model_type 'hstu' and format_version {FORMAT_VERSION}")
        expected = tensor_shapes(config)
        got = {name: tuple(w.shape) for name, w in weights.items()}
        if got != expected:
            raise ValueError(f"{WEIGHTS}: tensors {sorted(got.items())} differ from {sorted(expected.items())}")
        self.config = config
        self.weights = {name: w.astype(np.float64) for name, w in weights.items()}

    @classmethod
    def load(cls, export_dir: Union[str, Path]) -> "HSTUSlice":
        """Read ``hstu/config.json`` and ``hstu/model.safetensors`` after checking the MANIFEST."""
        root = Path(export_dir)
        verify_manifest(root)
        config = json.loads((root / CONFIG).read_text(encoding="utf8"))
        if config.get("torch_dtype") not in ("float32", "bfloat16"):
            raise ValueError(f"{CONFIG}: torch_dtype {config.get('torch_dtype')!r}, expected float32 or bfloat16")
        return cls(config, read_safetensors(root / WEIGHTS))

    def forward(
        self,
        x: np.ndarray,
        timestamps: np.ndarray,
        seq_offsets: np.ndarray,
        num_targets: np.ndarray,
        query_times: Optional[np.ndarray] = None,
    ) -> np.ndarray:
        """x: [T, D] float, timestamps: [T] int64, seq_offsets: [B+1] int64, num_targets: [B] int64,
        query_times: [T] int64 (read for "next_event" time bias) -> [T, D] float64 (section 2)."""
        c = self.config
        if c["query_time"] == "next_event" and c["time_buckets"] > 0 and query_times is None:
            raise ValueError("query_times: required when query_time is 'next_event' and time_buckets > 0")
        tq = timestamps if c["query_time"] == "token" or query_times is None else query_times
        out = np.empty(x.shape, dtype=np.float64)
        for b in range(len(num_targets)):
            rows = slice(int(seq_offsets[b]), int(seq_offsets[b + 1]))
            out[rows] = self._sequence(
                np.asarray(x[rows], np.float64),
                np.asarray(timestamps[rows], np.int64),
                np.asarray(tq[rows], np.int64),
                int(num_targets[b]),
            )
        return out

    def _sequence(self, x: np.ndarray, ts: np.ndarray, tq: np.ndarray, num_targets: int) -> np.ndarray:
        """One sequence: x [n, D] -> [n, D]."""
        c, w = self.config, self.weights
        n, hist, m = x.shape[0], x.shape[0] - num_targets, c["max_position_embeddings"]
        if hist > m:
            raise ValueError(f"a history of {hist} tokens exceeds max_position_embeddings {m}")
        index = np.arange(n)
        pos = np.minimum(index, hist)  # section 3
        h = x * (math.sqrt(c["hidden_size"]) if c["scale_input"] else 1.0)
        if c["position_embedding"]:
            h = h + w["embed_positions.weight"][pos]
        rel = pos[:, None] - pos[None, :]  # [n, n] query t, key j
        visible = (index[:, None] == index[None, :]) | (
            (rel > 0) & ((c["max_attn_len"] == 0) | (rel <= c["max_attn_len"]))
        )
        visible |= (index[None, :] < c["contextual_len"]) & (index[None, :] < hist)  # section 4.1
        norm = np.full(n, 1.0 / m) if c["attn_norm"] == "max_seq_len" else 1.0 / (pos + 1.0)  # section 4.4
        pos_bucket = np.clip(rel, 0, position_buckets(c) - 1)
        t_bucket = None
        if c["time_buckets"] > 0:  # section 4.3
            t_bucket = time_bucket(
                tq[:, None] - ts[None, :], c["time_bucketing"], c["time_buckets"], c["time_bucket_log_divisor"]
            )
        for i in range(c["num_hidden_layers"]):
            rab = np.zeros((n, n))
            if position_buckets(c) > 0:
                rab += w[f"layers.{i}.relative_position_bias"][pos_bucket]
            if t_bucket is not None:
                rab += w[f"layers.{i}.relative_time_bias"][t_bucket]
            h = self._layer(h, i, rab, visible, norm)
        return h

    def _layer(self, h: np.ndarray, i: int, rab: np.ndarray, visible: np.ndarray, norm: np.ndarray) -> np.ndarray:
        """Section 4: h [n, D], rab [n, n], visible [n, n] bool, norm [n] -> [n, D]."""
        c, p = self.config, f"layers.{i}."
        w = {name[len(p) :]: t for name, t in self.weights.items() if name.startswith(p)}
        heads, da, dl, eps = c["num_attention_heads"], c["attention_dim"], c["linear_dim"], c["layer_norm_eps"]
        n = h.shape[0]
        z = _layer_norm(h, w["input_layernorm.weight"], w["input_layernorm.bias"], eps)

        def project(name: str) -> np.ndarray:
            return _silu(z @ w[name + ".weight"].T + w[name + ".bias"])

        u = project("u_proj")
        v = project("v_proj").reshape(n, heads, dl)
        q = project("q_proj").reshape(n, heads, da)
        k = project("k_proj").reshape(n, heads, da)
        logits = c["alpha"] * np.einsum("thd,jhd->htj", q, k) + rab[None]
        scores = _silu(logits) * norm[None, :, None] * visible[None]
        a = np.einsum("htj,jhd->thd", scores, v).reshape(n, heads * dl)
        mixed = _layer_norm(a, w["attn_layernorm.weight"], w["attn_layernorm.bias"], eps) * u
        return h + mixed @ w["o_proj.weight"].T + w["o_proj.bias"]
