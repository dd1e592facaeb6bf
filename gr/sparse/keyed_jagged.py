"""Id batches: ``KeyedJaggedTensor`` and ``JaggedTensor``, the part of TorchRec's API that gr uses, in plain torch.

Batches carry their sparse ids in these, so building, cutting and moving batches needs no
TorchRec; the TorchRec backend turns them into TorchRec's own KJT at the lookup
(``gr.sparse.torchrec_tables.keyed_jagged``). TorchRec's classes have the same methods, so
either kind is accepted wherever gr reads ids.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence

import torch
from torch import Tensor

from gr.jagged import offsets_from_lengths


class _Jagged:
    """values [N] and lengths [S] int64 (sum N): S runs of values."""

    def __init__(self, values: Tensor, lengths: Tensor) -> None:
        self._values = values
        self._lengths = lengths

    def values(self) -> Tensor:
        return self._values

    def lengths(self) -> Tensor:
        return self._lengths

    def offsets(self) -> Tensor:
        """[len(lengths)+1] int64: the cumulative lengths from 0."""
        return offsets_from_lengths(self._lengths)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(values={self._values}, lengths={self._lengths})"


class JaggedTensor(_Jagged):
    """One feature's ids for B samples: values [N], lengths [B] int64 (sum N)."""


class KeyedJaggedTensor(_Jagged):
    """Several features' ids for the same B samples, key-major: values [N], lengths [F*B] int64
    (feature f's samples at lengths[f*B:(f+1)*B]); ``stride()`` is B."""

    def __init__(self, keys: Sequence[str], values: Tensor, lengths: Tensor, stride: Optional[int] = None) -> None:
        super().__init__(values, lengths)
        self._keys = list(keys)
        self._stride = stride if stride is not None else (lengths.numel() // len(self._keys) if self._keys else 0)
        if self._stride * len(self._keys) != lengths.numel():
            raise ValueError(
                f"KeyedJaggedTensor: {lengths.numel()} lengths do not split into {len(self._keys)} keys "
                f"of {self._stride} samples"
            )

    @classmethod
    def from_lengths_sync(cls, keys: Sequence[str], values: Tensor, lengths: Tensor) -> "KeyedJaggedTensor":
        return cls(keys, values, lengths)

    @classmethod
    def from_jt_dict(cls, jt_dict: Mapping[str, JaggedTensor]) -> "KeyedJaggedTensor":
        """{feature: JaggedTensor of the same B samples} -> one KJT, keys in the mapping's order."""
        jagged = list(jt_dict.values())
        if not jagged:
            raise ValueError("KeyedJaggedTensor.from_jt_dict: no features")
        stride = jagged[0].lengths().numel()
        return cls(
            list(jt_dict),
            torch.cat([jt.values() for jt in jagged]),
            torch.cat([jt.lengths() for jt in jagged]),
            stride,
        )

    def keys(self) -> List[str]:
        return self._keys

    def stride(self) -> int:
        return self._stride

    def length_per_key(self) -> List[int]:
        """Ids per feature (one host sync)."""
        if not self._keys:
            return []
        return self._lengths.view(len(self._keys), self._stride).sum(1).tolist()

    def to_dict(self) -> Dict[str, JaggedTensor]:
        """{feature: its JaggedTensor}: views of this KJT's values and lengths."""
        values = torch.split(self._values, self.length_per_key())
        lengths = torch.split(self._lengths, self._stride)
        return {key: JaggedTensor(v, n) for key, v, n in zip(self._keys, values, lengths)}

    def __getitem__(self, key: str) -> JaggedTensor:
        return self.to_dict()[key]

    def to(self, device: torch.device, non_blocking: bool = False) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(
            self._keys,
            self._values.to(device, non_blocking=non_blocking),
            self._lengths.to(device, non_blocking=non_blocking),
            self._stride,
        )

    def __repr__(self) -> str:
        return f"KeyedJaggedTensor(keys={self._keys}, values={self._values}, lengths={self._lengths})"
