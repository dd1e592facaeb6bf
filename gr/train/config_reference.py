"""Every config key with its type, default and what it accepts, read from the config
dataclasses themselves (``gr train --help``), so the list cannot drift from the code."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Iterator, List, Mapping, Tuple

from gr.data.config import RankingConfig
from gr.sparse.config import TableConfig
from gr.train.config import ModelSection, ModuleSpec, TrainConfig

NO_DEFAULT = "(required)"
# Defaults that the field alone does not tell.
DEFAULTS = {
    "model.tables[].num_embeddings": "null (the largest cardinality of the table's features in the data)",
    "model.tables[].sharding": "null (row_wise for sequence tables, table_wise for common ones)",
    "model.tables[].optimizer": "null (sparse.optimizer)",
    **{
        f"data.ranking.{key}": f"{getattr(RankingConfig(), key)} (0 under candidates: impressions: no item is sampled)"
        for key in ("num_negatives", "eval_num_negatives")
    },
}


@dataclass(frozen=True)
class ConfigKey:
    """One key: dotted path (``trainer.max_epochs``; list items as ``model.tables[].name``),
    type, default as YAML text, and what a valid value is (from the field's check, if any)."""

    path: str
    type: str
    default: str
    expects: str = ""


def config_keys() -> List[ConfigKey]:
    """All keys of ``TrainConfig``, section by section, in declaration order."""
    return list(_keys(TrainConfig, ""))


def format_reference() -> str:
    """The keys as an aligned text table (one line per key)."""
    keys = config_keys()
    width = max(len(k.path) for k in keys)
    type_width = max(len(k.type) for k in keys)
    lines = ["config keys (override any with --<key> VALUE; list items by index, e.g. --model.tables.0.embedding_dim):"]
    for key in keys:
        expects = f"  {key.expects}" if key.expects else ""
        lines.append(f"  {key.path:<{width}}  {key.type:<{type_width}}  default {key.default}{expects}")
    return "\n".join(lines)


def _keys(cls: type, prefix: str) -> Iterator[ConfigKey]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        hint = hints[f.name]
        if cls is TableConfig and f.name == "extra":
            continue  # not a config key: TableConfig.from_dict ignores it
        if cls is ModelSection and f.name == "class_path":
            yield ConfigKey(f"{prefix}class", "str", str(f.default), "an import path to a GRModel subclass")
        elif cls is ModelSection and f.name == "code_path":
            yield ConfigKey(path, "list[str]", "[]", "directories put on sys.path before the classes import")
        elif cls is ModelSection and f.name == "tables":
            yield from _keys(TableConfig, f"{path}[].")
        elif hint is ModuleSpec:
            yield ConfigKey(f"{path}.class", "str", "(the built-in class)", "an import path like package.module.Class")
            yield ConfigKey(f"{path}.kwargs", "mapping", "{}", "constructor arguments of the class")
        elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
            yield from _keys(hint, f"{path}.")
        elif _optional_section(hint) is not None:  # a section that is off (null) unless given
            yield ConfigKey(path, "mapping | null", "null", "the section below, or null (off)")
            yield from _keys(_optional_section(hint), f"{path}.")
        else:
            check = f.metadata.get("check")
            yield ConfigKey(path, type_name(hint), DEFAULTS.get(path) or _default(f), check[1] if check else "")


def _optional_section(hint: Any) -> Any:
    """The dataclass of an ``Optional[<dataclass>]`` hint, else None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is typing.Union else []
    return args[0] if len(args) == 1 and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]) else None


def type_name(hint: Any) -> str:
    """``Optional[int]`` -> ``int | null``, ``Tuple[str, ...]`` -> ``list[str]``, a dataclass -> ``mapping``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return " | ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin in (tuple, list):
        items = [a for a in args if a is not Ellipsis]
        if len(set(items)) == 1:
            return f"list[{type_name(items[0])}]"
        return f"list[{', '.join(type_name(a) for a in items)}]" if items else "list"
    if origin in (dict, Mapping) or origin is typing.get_origin(Mapping[str, int]):
        return "mapping"
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return f"mapping ({hint.__name__})"
    if hint is Any:
        return "any"
    return getattr(hint, "__name__", str(hint))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return NO_DEFAULT
    return _yaml_text(value)


def _yaml_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_yaml_text(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return "{" + ", ".join(f"{k}: {_yaml_text(v)}" for k, v in _plain_fields(value)) + "}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_yaml_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def _plain_fields(value: Any) -> List[Tuple[str, Any]]:
    return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
