"""MovieLens-100K for the tests: where the real files are (``ml_100k_path``, read through the
``ml_100k`` fixture of conftest.py), a small directory in its format for the tests of
``examples/custom_project`` (genres and demographics), and the overrides that train that
example's config in seconds."""

import os
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
CUSTOM_PROJECT = ROOT / "examples" / "custom_project" / "config.yaml"
ML_100K_ENV = "GR_ML100K_DIR"
ML_100K_DEFAULT = "data/ml-100k"  # where `gr data download ml-100k data/ml-100k` writes it
ML_100K_DOWNLOAD = f"gr data download ml-100k {ML_100K_DEFAULT}"
OCCUPATIONS = ("artist", "doctor", "student", "technician")


def ml_100k_path() -> Path:
    """The real MovieLens-100K directory: ``$GR_ML100K_DIR`` if set (a relative path is taken from
    the repository root; CI sets ``../shared/data/ml-100k``), else ``data/ml-100k`` in the
    repository. It may not exist: tests take it through the ``ml_100k`` fixture, which skips them."""
    return ROOT / (os.environ.get(ML_100K_ENV) or ML_100K_DEFAULT)


def ml_100k_missing() -> str:
    """The one-line reason to skip a test when ``ml_100k_path()`` holds no MovieLens-100K, else ""."""
    path = ml_100k_path()
    if (path / "u.data").is_file():
        return ""
    where = os.environ.get(ML_100K_ENV) or ML_100K_DEFAULT
    return f"MovieLens-100K not found at {where} (set {ML_100K_ENV}, or run `{ML_100K_DOWNLOAD}`)"


def small_ml_100k(root: Path, users: int = 40, items: int = 60, seed: int = 0) -> Path:
    """A MovieLens-100K-format directory (u.data, u.item with 19 genre flags, u.user)."""
    rng = np.random.default_rng(seed)
    root.mkdir()
    ratings = []
    for u in range(1, users + 1):
        for k, item in enumerate(rng.choice(np.arange(1, items + 1), size=int(rng.integers(8, 16)), replace=False)):
            ratings.append(f"{u}\t{item}\t{int(rng.integers(1, 6))}\t{880000000 + 3600 * k + u}\n")
    (root / "u.data").write_text("".join(ratings))
    flags = [rng.random(19) < 0.15 for _ in range(items)]
    (root / "u.item").write_text(
        "".join(
            f"{i}|Movie {i}|01-Jan-1995||http://x|{'|'.join(str(int(f)) for f in flags[i - 1])}\n"
            for i in range(1, items + 1)
        )
    )
    (root / "u.user").write_text(
        "".join(
            f"{u}|{int(rng.integers(12, 70))}|{'MF'[u % 2]}|{OCCUPATIONS[u % len(OCCUPATIONS)]}|00000\n"
            for u in range(1, users + 1)
        )
    )
    return root


SMALL = [
    ("trainer.max_epochs", "1"),
    ("trainer.enable_progress_bar", "false"),
    ("data.max_seq_len", "20"),
    ("model.hstu.max_seq_len", "20"),
    ("data.batch_size", "16"),
    ("task.retrieval.num_negatives", "16"),
]
