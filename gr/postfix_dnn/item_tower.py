"""The item tower: retrieval's item vector from the item's id row and its item features.

An item's vector is ``keep * id_row + encoder(its item features)`` [M, d]: ``ItemEncoder`` has
parameters of its own (an ``nn.EmbeddingBag``, mean pooling, per categorical or list-valued
feature; dense features and the popularity as they are), concatenated and projected to the item table's dim by a
projection that starts at zero, so training starts from the model without the tower. In
training, ``keep`` zeroes the id row of each looked-up item occurrence with probability
``id_dropout``, so the features alone learn to score an item; in evaluation ``keep`` is 1.

The items' feature values (the catalogue attributes: each model item's categorical ids, bag of
list ids, dense vector) are data, not parameters: ``ItemTower.set_items`` gives them from the
data, as non-persistent buffers (no checkpoint holds them). The encoder may also read the item's
popularity (``POPULARITY_FEATURE``: ``log1p`` of its training count, a dense feature of width 1
derived from the counts ``set_items`` is given), so an item without a trained row is placed by how
often it occurs as well as by what it is. The tower replaces, in the looked-up
rows of ``GRModel``, the item feature's token rows (what the PrefixDNN reads) and the sampled
items' rows (what the retrieval loss scores); evaluation and export apply it to the catalogue.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import Tensor, nn

from gr.jagged import offsets_from_lengths
from gr.jagged_rows import JaggedRows
from gr.prefix_dnn.mlp_encoder import mlp
from gr.sparse.keyed_jagged import KeyedJaggedTensor

FEATURE_KINDS = ("categorical", "list", "dense", "popularity")
POPULARITY_FEATURE = "item_popularity"  # the "popularity" feature's name: no data column declares it
UNPOOLED = ("dense", "popularity")  # kinds read as they are (no bag)
Values = Union[Tensor, Tuple[Tensor, Tensor]]  # [n] ids | ([V] ids, [n+1] offsets) | [n, d] floats
Column = Union[np.ndarray, JaggedRows]  # [rows] int64 | rows of int64 ids | [rows, d] float32


@dataclass(frozen=True)
class TowerFeature:
    """One item feature the encoder reads. kind: "categorical" (one id per item), "list" (a bag of
    ids), "dense" or "popularity" (``log1p`` of the item's count, width 1, derived from the counts
    ``ItemTower.set_items`` is given); rows: its bag's rows (ids < rows; 0 for the unpooled kinds);
    dim: its bag's embedding dim, or the unpooled feature's width."""

    name: str
    kind: str
    rows: int
    dim: int


class ItemEncoder(nn.Module):
    """Item features -> [n, embedding_dim]: each feature's bag pooled by mean (an empty bag: zeros),
    dense features as they are, concatenated, then ``mlp_dims`` layers (SiLU between) and a final
    projection to embedding_dim whose weights start at zero."""

    def __init__(self, features: Sequence[TowerFeature], embedding_dim: int, mlp_dims: Sequence[int] = ()) -> None:
        super().__init__()
        unknown = [f.kind for f in features if f.kind not in FEATURE_KINDS]
        if not features or unknown:
            raise ValueError(f"ItemEncoder.features: expected kinds in {list(FEATURE_KINDS)}, got {features!r}")
        self.features = tuple(features)
        self.embedding_dim = embedding_dim
        self.mlp_dims = tuple(mlp_dims)
        self.bags = nn.ModuleDict(
            {
                f.name: nn.EmbeddingBag(f.rows, f.dim, mode="mean", include_last_offset=True)
                for f in self.features
                if f.kind not in UNPOOLED
            }
        )
        self.mlp = mlp(sum(f.dim for f in self.features), [*self.mlp_dims, embedding_dim])
        last = self.mlp[-1]
        assert isinstance(last, nn.Linear)  # mlp ends with its projection
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)

    def forward(self, values: Mapping[str, Values]) -> Tensor:
        """values: {feature: [n] int64 ids (categorical) | ([V] int64 ids, [n+1] offsets) (list) |
        [n, dim] float (dense)} -> [n, embedding_dim]."""
        parts = []
        for feature in self.features:
            value = values[feature.name]
            if feature.kind in UNPOOLED:
                assert isinstance(value, Tensor)
                parts.append(value.float())
                continue
            if feature.kind == "categorical":
                assert isinstance(value, Tensor)
                ids, offsets = value, torch.arange(value.numel() + 1, device=value.device)
            else:
                ids, offsets = value
            parts.append(self.bags[feature.name](ids, offsets))
        return self.mlp(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1))

    def metadata(self) -> Dict[str, str]:
        """What rebuilds this encoder (``from_metadata``), as safetensors metadata (strings)."""
        return {
            "features": json.dumps([asdict(f) for f in self.features]),
            "embedding_dim": str(self.embedding_dim),
            "mlp_dims": json.dumps(list(self.mlp_dims)),
        }

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str]) -> "ItemEncoder":
        """The encoder ``metadata()`` describes (fresh weights: load its state dict next)."""
        features = [TowerFeature(**f) for f in json.loads(metadata["features"])]
        return cls(features, int(metadata["embedding_dim"]), json.loads(metadata["mlp_dims"]))

    def encode_columns(self, columns: Mapping[str, Column]) -> Tensor:
        """columns: {feature: [n] int64 | n rows of ids (JaggedRows) | [n, dim] float32}, row i one
        item's -> [n, embedding_dim] (no gradient)."""
        values: Dict[str, Values] = {}
        for feature in self.features:
            column = columns[feature.name]
            if isinstance(column, JaggedRows):
                values[feature.name] = (torch.from_numpy(column.values), torch.from_numpy(column.offsets))
            else:
                values[feature.name] = torch.from_numpy(np.ascontiguousarray(column))
        with torch.no_grad():
            return self(values)


def reads_popularity(encoder: ItemEncoder) -> bool:
    """Whether ``encoder`` reads the items' popularity (a feature of kind "popularity")."""
    return any(f.kind == "popularity" for f in encoder.features)


def popularity_columns(encoder: ItemEncoder, counts: Optional[np.ndarray]) -> Dict[str, Column]:
    """The encoder's popularity input of n items: {its popularity feature: [n, 1] float32
    ``log1p(counts)``} from counts: [n] int64 >= 0; {} when it reads none. ValueError when it reads
    one and ``counts`` is None."""
    names = [f.name for f in encoder.features if f.kind == "popularity"]
    if names and counts is None:
        raise ValueError("model.item_tower.popularity: the items' training counts were not given")
    if not names:
        return {}
    column = np.log1p(np.asarray(counts, dtype=np.float64)).astype(np.float32)[:, None]
    return {name: column for name in names}


class ItemTower(nn.Module):
    """``keep * id_row + encoder(item features)`` of each looked-up item (module docstring).

    item_feature: the token feature holding the item; keys: the looked-up features whose rows are
    items (the item feature, and in training the sampled items); num_items: the item table's rows."""

    def __init__(
        self, item_feature: str, keys: Sequence[str], num_items: int, encoder: ItemEncoder, id_dropout: float
    ) -> None:
        super().__init__()
        self.item_feature = item_feature
        self.keys = tuple(keys)
        self.num_items = num_items
        self.encoder = encoder
        self.id_dropout = id_dropout
        self.has_items = False

    def set_items(self, columns: Mapping[str, Column], popularity: Optional[np.ndarray] = None) -> None:
        """Give each model item's features: {feature: [items] int64 | items rows of ids | [items, d]
        float32}, row i model item i's (e.g. the data module's ``item_features``); rows past the
        item table's are dropped, items without a row get the unknown id 0, an empty bag, zeros.
        popularity: [items] int64 training counts, required when the encoder reads them."""
        columns = {**columns, **popularity_columns(self.encoder, popularity)}
        missing = [f.name for f in self.encoder.features if f.name not in columns]
        if missing:
            raise ValueError(f"model.item_tower.features: the data has no item values for {missing}")
        rows = self.num_items
        device = next(self.encoder.parameters()).device
        for feature in self.encoder.features:
            column = columns[feature.name]
            if feature.kind == "list":
                if not isinstance(column, JaggedRows):
                    raise ValueError(f"model.item_tower.features: {feature.name!r} is not a list-valued feature")
                index = np.arange(rows)
                bags = column.take(np.where(index < len(column), index, -1))
                self._buffer(f"{feature.name}_ids", torch.from_numpy(bags.values.astype(np.int64)), device)
                self._buffer(f"{feature.name}_offsets", torch.from_numpy(bags.offsets.astype(np.int64)), device)
                continue
            array = np.asarray(column)
            padded = np.zeros((rows, *array.shape[1:]), dtype=np.int64 if feature.kind == "categorical" else np.float32)
            padded[: min(rows, len(array))] = array[:rows]
            self._buffer(feature.name, torch.from_numpy(padded), device)
        self.has_items = True

    def _buffer(self, name: str, value: Tensor, device: torch.device) -> None:
        self.register_buffer(f"items_{name}", value.to(device), persistent=False)

    def _items(self, name: str) -> Tensor:
        return getattr(self, f"items_{name}")

    def item_features(self, items: Tensor) -> Dict[str, Values]:
        """items: [n] model ids -> the encoder's input for them."""
        if not self.has_items:
            raise RuntimeError("ItemTower: no item features given; call set_items with the data's items first")
        values: Dict[str, Values] = {}
        for feature in self.encoder.features:
            if feature.kind != "list":
                values[feature.name] = self._items(feature.name)[items]
                continue
            all_ids, all_offsets = self._items(f"{feature.name}_ids"), self._items(f"{feature.name}_offsets")
            starts = all_offsets[items]
            lengths = all_offsets[items + 1] - starts
            offsets = offsets_from_lengths(lengths)
            shift = torch.repeat_interleave(starts - offsets[:-1], lengths)
            values[feature.name] = (all_ids[shift + torch.arange(shift.numel(), device=items.device)], offsets)
        return values

    def forward(self, items: Tensor, id_rows: Tensor) -> Tensor:
        """items: [n] int64 model ids, id_rows: [n, d] their table rows -> [n, d] item vectors."""
        if self.training and self.id_dropout > 0:
            keep = torch.rand(items.numel(), 1, device=id_rows.device) >= self.id_dropout
            id_rows = id_rows * keep
        return self.item_vectors(items, id_rows)

    def embed_tokens(self, token: Dict[str, Tensor], sequence_ids: Optional[KeyedJaggedTensor]) -> Dict[str, Tensor]:
        """The looked-up rows {feature: [N_f, d]} with each of ``keys`` present replaced by its items' vectors."""
        if sequence_ids is None:
            return token
        present = set(sequence_ids.keys())
        return {
            name: self(sequence_ids[name].values(), rows) if name in self.keys and name in present else rows
            for name, rows in token.items()
        }

    def item_vectors(self, items: Tensor, id_rows: Tensor) -> Tensor:
        """As ``forward`` in evaluation mode (whole id rows), whatever the module's mode: the
        vectors that evaluation ranks and an export stores."""
        return id_rows + self.feature_vectors(items.to(id_rows.device)).to(id_rows.dtype)

    def feature_vectors(self, items: Tensor) -> Tensor:
        """items: [n] int64 model ids -> [n, d] their vectors without an id row: what an item the
        table has no trained row for (``gr items add``) is scored by."""
        return self.encoder(self.item_features(items))
