"""An export's new-user state: ``hstu/empty_history.safetensors`` (optional), one float32 tensor
``empty_history`` [hidden_dim]: the HSTU output of a user with no history (``GRModel.empty_history``,
learned with ``task.retrieval.new_user_query``). Serving answers a request with an empty history and
the user's common features from ``postfix_dnn(empty_history, common features)`` through the postfix
slice (``"fallback": "user_features"``); an export without it answers such a request from popularity.
Covered by the MANIFEST like every other file; ``check_empty_history`` is what ``gr check`` and every
loader verify.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from gr.export.format import HSTU_CONFIG, Problem, read_safetensors
from gr.utils.atomic import write_bytes

EMPTY_HISTORY_FILE = "hstu/empty_history.safetensors"
EMPTY_HISTORY_TENSOR = "empty_history"


def write_empty_history(root: Path, state: torch.Tensor) -> None:
    """Write ``state`` [hidden_dim] (float32) to ``root/hstu/empty_history.safetensors``."""
    tensor = state.detach().to(torch.float32).cpu().contiguous()
    write_bytes(root / EMPTY_HISTORY_FILE, safetensors_bytes({EMPTY_HISTORY_TENSOR: tensor}))


def check_empty_history(root: Path, hidden_dim: int, problems: List[Problem]) -> None:
    """Add a problem when the export's new-user state is unreadable, not one finite float32 tensor
    ``empty_history`` [hidden_dim] (``hstu/config.json``'s), or holds other tensors."""
    path = root / EMPTY_HISTORY_FILE
    if not path.exists():
        return
    read = read_safetensors(root, EMPTY_HISTORY_FILE, problems, framework="pt")
    if read is None:
        return
    tensors = read[1]
    state = tensors.get(EMPTY_HISTORY_TENSOR)
    if set(tensors) != {EMPTY_HISTORY_TENSOR} or state is None:
        problems.append(
            Problem(EMPTY_HISTORY_FILE, "-", f"expected the one tensor {EMPTY_HISTORY_TENSOR!r}, got {sorted(tensors)}")
        )
    elif state.dtype != torch.float32 or tuple(state.shape) != (hidden_dim,):
        problems.append(
            Problem(
                EMPTY_HISTORY_FILE,
                EMPTY_HISTORY_TENSOR,
                f"{str(state.dtype).removeprefix('torch.')} {list(state.shape)}, expected float32 [{hidden_dim}] "
                f"({HSTU_CONFIG} hidden_dim)",
            )
        )
    elif not bool(torch.isfinite(state).all()):
        problems.append(Problem(EMPTY_HISTORY_FILE, EMPTY_HISTORY_TENSOR, "holds NaN or infinite values"))


def read_empty_history(root: Path) -> Optional[np.ndarray]:
    """[hidden_dim] float32 of a checked export, or None when it stores none."""
    path = root / EMPTY_HISTORY_FILE
    return load_file(str(path))[EMPTY_HISTORY_TENSOR].numpy() if path.is_file() else None
