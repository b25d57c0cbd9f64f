"""The versions of the packages that write a checkpoint, recorded in its tree record.

A checkpoint that "wrote successfully for 5 days" can still fail to resume after a
package update changed a serialization detail. Recording who wrote each step lets
``jaxckpt inspect`` (and a person debugging a failed resume) see it at once. Imports
neither jax nor numpy: versions come from the installed distributions' metadata.
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
from collections.abc import Mapping
from types import MappingProxyType

#: Distributions whose versions every tree record carries, in this order.
PACKAGES = ("jaxckpt", "jax", "jaxlib", "orbax-checkpoint", "tensorstore", "numpy")


@functools.cache
def writer_versions() -> Mapping[str, str]:
    """``{distribution: version}`` of this process's writer stack, plus ``python``.

    >>> sorted(writer_versions())[:3]
    ['jax', 'jaxckpt', 'jaxlib']
    """
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    out["python"] = platform.python_version()
    return MappingProxyType(out)


def versions_text(versions: Mapping[str, str] | None) -> str:
    """One line for ``jaxckpt inspect``.

    >>> versions_text({"jaxckpt": "0.1.0", "jax": "0.10.2"})
    'jaxckpt 0.1.0, jax 0.10.2'
    >>> versions_text(None)
    'not recorded (written before jaxckpt recorded versions)'
    """
    if not versions:
        return "not recorded (written before jaxckpt recorded versions)"
    return ", ".join(f"{name} {version}" for name, version in versions.items())
