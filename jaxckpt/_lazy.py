"""The faces' lazy names: a package's module ``__getattr__`` (PEP 562) that imports a
name's module on first use, so that light modules stay free of jax and TensorStore."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str, modules: Mapping[str, str], namespace: MutableMapping[str, Any]
) -> Callable[[str], Any]:
    """``package``'s ``__getattr__``: each name of ``modules`` (name -> module) is imported
    from its module when first asked for and kept in ``namespace`` (the package's globals).
    """

    def getattr_(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return getattr_
