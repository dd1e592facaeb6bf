"""Raw ids <-> model ids at serving time, through the maps an export carries in ``sparse/id_maps/``.

A feature whose ``sparse.ini`` entry names an ``id_mapping`` takes the dataset's raw ids
(int or str, as its map declares); a feature without one has no raw id space, so its ids are
the model ids. An unknown raw id is a ``RequestError`` naming it (``unknown_ids="error"``, the
default); with ``unknown_ids="oov"`` it becomes row 0 where the map reserves that row for
unknown ids (maps with offset 1, the categorical side features) and stays an error elsewhere,
except in a history: there a token whose item has no row is left out
(``gr.serving.history.without_unknown_items``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np

from gr.data.mappings import IdMap
from gr.export.id_maps import read_id_maps
from gr.export.sparse_manifest import SparseManifest
from gr.serving.errors import IdMapError, RequestError


class IdMaps:
    """{feature: IdMap} of one export; ``encode`` raw -> model ids, ``decode`` model -> raw ids."""

    def __init__(self, root: Path, sparse: SparseManifest) -> None:
        self.mapped = {name for name, f in sparse.features.items() if f.id_mapping is not None}
        maps, problems = read_id_maps(root, sparse)  # what gr check reports, read the same way
        self.maps: Dict[str, IdMap] = maps
        # why the maps cannot be used (raw ids of mapped features then fail); open_export refuses it first
        self.problem: Optional[str] = (f"{root}: " + "; ".join(map(str, problems))) if problems else None

    def _map(self, feature: str) -> Optional[IdMap]:
        if feature in self.mapped and self.problem is not None:
            raise IdMapError(self.problem)
        return self.maps.get(feature)

    def encode(self, feature: str, values: Any, where: str, unknown_ids: str = "error") -> Any:
        """values: [n] raw ids of ``feature`` -> [n] int64 model ids (unchanged for an unmapped feature)."""
        id_map = self._map(feature)
        if id_map is None:
            return values
        raw = np.asarray(values)
        if raw.size == 0:
            return np.zeros(0, dtype=np.int64)
        if not _raw_ids_of(id_map, raw):
            kind = "integers" if id_map.raw.dtype.kind in "iu" else "strings"
            raise RequestError(
                f"{where}: expected a list of raw ids ({kind}, as in the id map), got {raw.tolist()!r}"[:300]
            )
        oov = 0 if unknown_ids == "oov" and id_map.offset >= 1 else None
        encoded = id_map.encode(raw, unknown=-1 if oov is None else oov)
        unknown = raw[encoded < 0]
        if unknown.size:
            raise RequestError(
                f"{where}: unknown raw id(s) {unknown[:5].tolist()} (not in the id map of "
                f"{feature!r}; unknown_ids={unknown_ids!r})"
            )
        return encoded

    def has_unknown_row(self, feature: str) -> bool:
        """Whether ``feature``'s map reserves model id 0 for unknown values (a categorical side feature)."""
        id_map = self.maps.get(feature)
        return id_map is not None and id_map.offset >= 1

    def rowless(self, feature: str, values: Any) -> Optional[np.ndarray]:
        """[n] bool: the raw ids among ``values`` that ``feature``'s map lacks and has no unknown row
        for (the item's map); None when ``feature`` has no such map or ``values`` are not a list of
        its raw ids (``encode`` then says why)."""
        id_map = self._map(feature)
        if id_map is None or id_map.offset > 0 or not isinstance(values, (list, tuple, np.ndarray)):
            return None
        raw = np.asarray(values)
        return id_map.encode(raw, unknown=-1) < 0 if raw.size and _raw_ids_of(id_map, raw) else None

    def decode(self, feature: str, ids: np.ndarray) -> list:
        """ids: [n] int64 model ids -> n raw ids (JSON-ready); unmapped feature: the ids themselves."""
        id_map = self._map(feature)
        if id_map is None:
            return np.asarray(ids).tolist()
        return id_map.decode(np.asarray(ids)).tolist()


def _raw_ids_of(id_map: IdMap, raw: np.ndarray) -> bool:
    """Whether ``raw`` is a flat array of ids of the kind ``id_map`` holds (ints for an int map)."""
    return raw.ndim == 1 and raw.dtype.kind in ("iu" if id_map.raw.dtype.kind in "iu" else "iuU")
