"""Which values a JSON round trip returns unchanged, checked without recursion.

JSON turns a tuple into a list and every dict key into a string (``{1: "a"}``
comes back as ``{"1": "a"}``), and Python's encoder recurses once per level
(a list 100,000 deep raised a bare ``RecursionError``). :func:`json_problem`
walks a value with an explicit stack and names the first thing JSON cannot
carry exactly, by its path (``['parents'][0]['seed']``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_DEPTH", "json_problem"]

MAX_DEPTH = 100
"""The most nested containers (dicts and lists) a value may have."""

_SCALARS = (str, int, float, bool, type(None))


def _type_name(value: Any) -> str:
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def json_problem(value: Any) -> str | None:
    """None when JSON carries ``value`` exactly; else what it cannot carry, named by path.

    Only exact types count (a ``str`` subclass or an ``IntEnum`` comes back as its base).

    >>> json_problem({"next_index": 17, "parents": [{"seed": 3}]}) is None
    True
    >>> json_problem({"parents": [{"seed": (3,)}]})
    "['parents'][0]['seed']: a tuple (JSON gives back a list: pass a list)"
    >>> json_problem({1: "a"})
    "key 1 (int) is not a str (JSON keys are strings: it would come back as '1')"
    """
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        item, path, depth = stack.pop()
        kind = type(item)
        if kind in _SCALARS:
            continue
        prefix = f"{path}: " if path else ""
        if kind is not list and kind is not dict:
            hint = " (JSON gives back a list: pass a list)" if kind is tuple else ""
            name = _type_name(item)
            return f"{prefix}{'an' if name[0] in 'aeiou' else 'a'} {name}{hint}"
        if depth > MAX_DEPTH:
            return f"{prefix}nested deeper than {MAX_DEPTH} levels of dicts and lists"
        if kind is list:
            stack.extend((x, f"{path}[{i}]", depth + 1) for i, x in enumerate(item))
            continue
        for key, x in item.items():
            if type(key) is not str:
                back = "true" if key is True else "false" if key is False else str(key)
                back = "null" if key is None else back
                return (
                    f"{prefix}key {key!r} ({_type_name(key)}) is not a str (JSON keys are "
                    f"strings: it would come back as {back!r})"
                )
            stack.append((x, f"{path}[{key!r}]", depth + 1))
    return None
