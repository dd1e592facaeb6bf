"""An export's id maps (``sparse/id_maps/``) read against ``sparse/sparse.ini``.

One reader for ``gr check`` (``check_export``) and the serving runtime (``gr.serving.id_maps``),
so whatever loads an export refuses exactly what the check reports: maps that do not read
(``gr.data.mappings.load_mappings``: a repeated raw id, unsorted ids, gaps in the dense ids, ...),
a feature's ``id_mapping`` that names no map, and a map whose dense ids pass its table's rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

from gr.data.mappings import MANIFEST, IdMap, load_mappings
from gr.export.format import ID_MAPS_DIR, SPARSE_INI, Problem
from gr.export.sparse_manifest import SparseManifest


def read_id_maps(root: Path, sparse: SparseManifest) -> Tuple[Dict[str, IdMap], List[Problem]]:
    """({feature: IdMap} of every feature whose sparse.ini entry names an ``id_mapping``, problems)."""
    mapped = {name: f for name, f in sparse.features.items() if f.id_mapping is not None}
    if not mapped:
        return {}, []
    try:
        by_name, _ = load_mappings(str(root / ID_MAPS_DIR))
    except (OSError, ValueError) as exc:  # the message names the file and line; shown relative to the export
        return {}, [Problem(ID_MAPS_DIR, "-", str(exc).replace(f"{root}/", ""))]
    maps: Dict[str, IdMap] = {}
    problems: List[Problem] = []
    for feature, entry in mapped.items():
        key = f"feature.{feature}.id_mapping"
        id_map = by_name.get(Path(str(entry.id_mapping)).name.removesuffix(".tsv"))
        table = sparse.tables[entry.table]
        if id_map is None:
            problems.append(
                Problem(
                    SPARSE_INI,
                    key,
                    f"{entry.id_mapping!r} is not a map of {ID_MAPS_DIR}/{MANIFEST} (maps: {sorted(by_name)})",
                )
            )
        elif id_map.cardinality > table.rows:
            problems.append(
                Problem(
                    SPARSE_INI,
                    key,
                    f"{entry.id_mapping} maps raw ids to rows up to {id_map.cardinality - 1}, but table "
                    f"{table.name} has {table.rows} rows (table.{table.name}.rows)",
                )
            )
        else:
            maps[feature] = id_map
    return maps, problems
