"""Tile configurations of the CUDA Triton kernels: a built-in table per architecture, and
autotuning once per key with the result kept on disk.

With autotuning off (``GR_TRITON_AUTOTUNE=0``) every launch takes the table's configuration for
its architecture: no benchmark runs and each kernel compiles once. With it on (the default on
CUDA), the first launch of a key times the architecture's candidates and stores the fastest in
the cache directory (``GR_TRITON_CACHE_DIR``, default ``~/.cache/gr/triton-tuning``), one JSON
file per key, written to a temporary file and renamed: processes may share the directory, a
reader sees a whole entry or none, and a corrupt entry is ignored with a warning (and replaced
by the next tuning). A second process with the same key autotunes nothing.

The key: GPU name, triton version, kernel, max length rounded up to a power of two (at least
16), head dims and dtype. The table's configurations compile in a few seconds each and do not
spill registers on sm_80 / sm_90 (``bench/triton_compile.py`` measures both).
Dtype names are torch's without the prefix ("float32", "bfloat16", "float16").
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

from gr.utils.atomic import write_json

ENV_AUTOTUNE = "GR_TRITON_AUTOTUNE"
ENV_CACHE_DIR = "GR_TRITON_CACHE_DIR"
FORMAT = 1
KERNELS = ("forward", "backward_dq", "backward_dkv", "cached_forward")  # the last: serving, not autotuned


@dataclass(frozen=True)
class TileConfig:
    """Block sizes (multiples of 16) and launch options of one kernel."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    def label(self) -> str:
        return f"{self.block_m}x{self.block_n}/w{self.num_warps}/s{self.num_stages}"


def parse_config(label: str) -> TileConfig:
    """ "64x32/w4/s2" -> TileConfig(64, 32, 4, 2): the inverse of ``TileConfig.label``."""
    match = re.fullmatch(r"(\d+)x(\d+)/w(\d+)/s(\d+)", label)
    if match is None:
        raise ValueError(f"expected a tile configuration MxN/wW/sS (e.g. 64x32/w4/s2), got {label!r}")
    return TileConfig(*map(int, match.groups()))


def _configs(*labels: str) -> List[TileConfig]:
    return [parse_config(label) for label in labels]


# Per operand class ("fp32": three tf32 products a dot; "16bit": bf16 / fp16; "/d64": head dims up
# to 64, "/d128": larger) and kernel: the candidates autotuning times, the first the default.
# Measured with bench/triton_compile.py on sm_80 and sm_90 at head dims 25, 50, 64 (d64) and 128
# (d128), every bias combination: each compiles in 1-3 s, and none spills a register except fp32
# dk/dv at head dims above 64 (16-64 bytes; no recipe runs it). Larger tiles, 4 warps on 64-row
# tiles or deeper pipelines spilled, in the 16-bit kernels at head dims that are not a multiple of
# 16 (loads element by element) first. fp32 tiles are small because each dot holds its operands
# twice (the tf32 high and low parts). The cached-attention kernel (serving: few new tokens, so 16-row
# tiles) takes one configuration, chosen among tiles of 16x16 to 32x64, 4 or 8 warps and 1 or 2 stages
# as one that spills nowhere on sm_80 and sm_90 at head dims 25, 50, 64 and 128 (``bench/triton_compile.py
# --kernels cached_forward``); its speed on a GPU is not measured.
_TABLE: Dict[str, Dict[str, List[TileConfig]]] = {
    "fp32/d64": {
        "forward": _configs("16x32/w8/s2", "16x32/w4/s1", "16x16/w4/s1"),
        "backward_dq": _configs("16x32/w4/s1"),
        "backward_dkv": _configs("16x16/w4/s1"),
        "cached_forward": _configs("16x32/w8/s1"),
    },
    "fp32/d128": {
        "forward": _configs("16x16/w8/s1", "16x16/w4/s2"),
        "backward_dq": _configs("16x32/w8/s1"),
        "backward_dkv": _configs("16x16/w8/s1"),
        "cached_forward": _configs("16x16/w8/s1"),
    },
    "16bit/d64": {
        "forward": _configs("32x64/w8/s2", "64x32/w8/s2", "32x32/w4/s2"),
        "backward_dq": _configs("64x32/w8/s2"),
        "backward_dkv": _configs("32x32/w8/s2", "16x32/w8/s2", "32x16/w4/s2"),
        "cached_forward": _configs("16x32/w4/s2"),
    },
    "16bit/d128": {
        "forward": _configs("32x64/w8/s2", "64x32/w8/s2", "32x32/w4/s1"),
        "backward_dq": _configs("32x64/w8/s2", "64x32/w8/s2", "32x32/w4/s1"),
        "backward_dkv": _configs("32x32/w8/s2", "16x32/w4/s2"),
        "cached_forward": _configs("16x32/w8/s2"),
    },
}
# Per architecture family (8: Ampere, 9: Hopper and later): measured apart, the same table won on both
CANDIDATES: Dict[int, Dict[str, Dict[str, List[TileConfig]]]] = {8: _TABLE, 9: _TABLE}


def arch_family(major: int) -> int:
    """The table row of a compute capability's major version (older than sm_80: Ampere's)."""
    return 9 if major >= 9 else 8


def operand_class(dtype: str, dim_qk: int, dim_v: int) -> str:
    """ "fp32/d64", "16bit/d128", ...: the table's column for operands of ``dtype`` (a name as in
    ``TuningKey.dtype``) and these head dims."""
    width = "d64" if max(dim_qk, dim_v) <= 64 else "d128"
    return f"{'fp32' if dtype == 'float32' else '16bit'}/{width}"


def candidates(major: int, kernel: str, dtype: str, dim_qk: int, dim_v: int) -> List[TileConfig]:
    """The configurations autotuning times for ``kernel`` on these operands, the default first."""
    return CANDIDATES[arch_family(major)][operand_class(dtype, dim_qk, dim_v)][kernel]


def default_config(major: int, kernel: str, dtype: str, dim_qk: int, dim_v: int) -> TileConfig:
    """The configuration ``kernel`` runs with when autotuning is off."""
    return candidates(major, kernel, dtype, dim_qk, dim_v)[0]


def autotune_enabled() -> bool:
    """``GR_TRITON_AUTOTUNE``: "0" (or "false", "off") turns autotuning off; on by default."""
    return os.environ.get(ENV_AUTOTUNE, "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE_DIR) or Path.home() / ".cache" / "gr" / "triton-tuning")


def length_bucket(max_seq_len: int) -> int:
    """Max length rounded up to a power of two, at least 16."""
    return max(16, 1 << max(int(max_seq_len) - 1, 0).bit_length())


@dataclass(frozen=True)
class TuningKey:
    gpu: str
    triton: str
    kernel: str
    max_len: int  # a power of two (``length_bucket``)
    dim_qk: int
    dim_v: int
    dtype: str

    def filename(self) -> str:
        text = (
            f"{self.gpu}-triton{self.triton}-{self.kernel}-L{self.max_len}-qk{self.dim_qk}-v{self.dim_v}-{self.dtype}"
        )
        return re.sub(r"[^A-Za-z0-9._-]+", "_", text) + ".json"


class TuningCache:
    """Autotuning results on disk, one JSON file per ``TuningKey`` in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def path(self, key: TuningKey) -> Path:
        return self.directory / key.filename()

    def get(self, key: TuningKey) -> Optional[TileConfig]:
        """The stored configuration of ``key``; None when absent, or (with a warning) unreadable."""
        path = self.path(key)
        try:
            entry = json.loads(path.read_text(encoding="utf8"))
        except (FileNotFoundError, NotADirectoryError):  # a directory that cannot hold entries: put says so
            return None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            warnings.warn(f"{path}: unreadable autotuning entry ignored ({err})", stacklevel=2)
            return None
        try:
            if entry["format"] != FORMAT or entry["key"] != asdict(key):
                raise ValueError("another format or key")
            config = TileConfig(**entry["config"])
            if any(not isinstance(v, int) or v <= 0 for v in asdict(config).values()):
                raise ValueError(f"config {entry['config']}")
        except (KeyError, TypeError, ValueError) as err:
            warnings.warn(f"{path}: invalid autotuning entry ignored ({err})", stacklevel=2)
            return None
        return config

    def put(self, key: TuningKey, config: TileConfig, timings_ms: Dict[str, float]) -> None:
        """Store ``config`` for ``key`` (atomically: temporary file, then rename). A cache that
        cannot be written (read-only, the directory a file, the entry a directory) stores nothing
        and warns: the warning names the directory and the reason, not the entry, so Python
        shows it once per process; the caller keeps the tiles it tuned in memory."""
        entry = {"format": FORMAT, "key": asdict(key), "config": asdict(config), "timings_ms": timings_ms}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_json(self.path(key), entry)
        except OSError as err:
            warnings.warn(
                f"{self.directory}: cannot store autotuning results ({err.strerror or err}; set "
                f"{ENV_CACHE_DIR} to a writable directory): tuned tiles are kept for this process only",
                stacklevel=2,
            )


def tune(
    key: TuningKey,
    candidates: List[TileConfig],
    time_ms: Callable[[TileConfig], float],
    cache: TuningCache,
) -> TileConfig:
    """The cached configuration of ``key``, or the fastest of ``candidates`` by ``time_ms``
    (stored). A candidate whose ``time_ms`` raises (e.g. out of shared memory) is skipped."""
    hit = cache.get(key)
    if hit is not None:
        return hit
    timings: Dict[TileConfig, float] = {}
    failures = []
    for config in candidates:
        try:
            timings[config] = float(time_ms(config))
        except Exception as err:  # a config the device cannot run: the others decide
            failures.append(f"{config.label()}: {err}")
    if not timings:
        raise RuntimeError(f"autotuning {key.kernel}: no candidate ran ({'; '.join(failures)})")
    best = min(timings, key=timings.__getitem__)
    cache.put(key, best, {config.label(): round(ms, 4) for config, ms in timings.items()})
    return best
