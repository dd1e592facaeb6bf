"""A small MovieLens-100K directory for the tests of ``examples/custom_project`` (genres and
demographics), and the overrides that train that example's config in seconds."""

from pathlib import Path

import numpy as np

CUSTOM_PROJECT = Path(__file__).resolve().parents[2] / "examples" / "custom_project" / "config.yaml"
OCCUPATIONS = ("artist", "doctor", "student", "technician")


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
