"""Config validation: the one idiom every config section uses (hstu, data, sparse, train, serving).

A section is a frozen dataclass whose fields are declared with ``checked(default, check)``
and which mixes in ``Section``: ``__post_init__`` calls ``self.validate(where)``, which
checks each field and raises ``ValueError("<where>.<field>: expected <what>, got <value>")``.
A check is a ``(predicate, what it expects)`` pair built from the helpers below; checks
that span fields call ``require`` (or raise with the same message shape) after ``validate``.
``known_keys`` refuses unknown keys before a section is built, naming them and the section.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any, Callable, Dict, Mapping, Tuple, cast

Check = Tuple[Callable[[Any], bool], str]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float (bools are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def int_at_least(minimum: int) -> Check:
    return (lambda v: is_int(v) and v >= minimum), f"an int >= {minimum}"


def number_in(low: float, high: float = math.inf, *, open_low: bool = False, open_high: bool = False) -> Check:
    def ok(v: Any) -> bool:
        return is_number(v) and (v > low if open_low else v >= low) and (v < high if open_high else v <= high)

    return ok, f"a number in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"


def one_of(*choices: Any) -> Check:
    return (lambda v: v in choices), f"one of {list(choices)}"


def optional(check: Check) -> Check:
    return (lambda v: v is None or check[0](v)), f"null or {check[1]}"


def list_of(check: Check, *, non_empty: bool = False) -> Check:
    def ok(v: Any) -> bool:
        return isinstance(v, (list, tuple)) and (bool(v) or not non_empty) and all(check[0](x) for x in v)

    return ok, f"a {'non-empty ' if non_empty else ''}list, each {check[1]}"


NUMBER: Check = (is_number, "a finite number")
BOOL: Check = ((lambda v: isinstance(v, bool)), "true or false")
NAME: Check = ((lambda v: isinstance(v, str) and bool(v)), "a non-empty string")
NAMES: Check = list_of(NAME)
PROBABILITY: Check = number_in(0.0, 1.0, open_high=True)
BETAS: Check = (
    (lambda v: isinstance(v, (list, tuple)) and len(v) == 2 and all(is_number(b) and 0 <= b < 1 for b in v)),
    "two numbers in [0, 1)",
)


def require(where: str, value: Any, check: Check) -> None:
    """Raise ``ValueError("<where>: expected <what>, got <value>")`` unless ``check`` accepts ``value``."""
    if not check[0](value):
        raise ValueError(f"{where}: expected {check[1]}, got {value!r}")


def checked(default: Any, check: Check) -> Any:
    """A dataclass field whose value ``Section.validate`` checks."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"check": check})
    return field(default=default, metadata={"check": check})


def known_keys(cls: type, values: Any, where: str, ignore: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """``values`` as a dict, refusing anything but a mapping of ``cls``'s dataclass fields
    (minus ``ignore``) with an error naming ``where``. None reads as an empty mapping."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ValueError(f"{where}: expected a mapping of keys to values, got {values!r}")
    known = {f.name for f in dataclasses.fields(cls)} - set(ignore)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(known)}")
    return dict(values)


class Section:
    """Mixin for a frozen config dataclass: build from a mapping, refusing unknown keys; check
    every field declared with ``checked``. Lists become tuples (the section stays hashable)."""

    def validate(self, where: str) -> None:
        for f in dataclasses.fields(cast(Any, self)):  # a mixin of dataclasses
            value = getattr(self, f.name)
            check = f.metadata.get("check")
            if check is not None:
                require(f"{where}.{f.name}", value, check)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))

    @classmethod
    def from_dict(cls, values: Any, where: str) -> Any:
        return cast(Any, cls)(**known_keys(cls, values, where), where=where)  # where: the dataclass's InitVar
