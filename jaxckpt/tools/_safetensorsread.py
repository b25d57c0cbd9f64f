"""safetensors read back: files, shard sets and directories, memory-mapped and checked.

The format and the writer: :mod:`jaxckpt.tools._safetensors`. Every header is checked
before use (its length, each tensor's dtype, shape and offsets against the file's size):
a file is untrusted input.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jaxckpt.errors import CheckpointError
from jaxckpt.tools._safetensors import _MAX_HEADER, _NUMPY, INDEX_FILE

__all__ = ["SafetensorsFormatError", "read_safetensors", "tree_from_names"]


class SafetensorsFormatError(CheckpointError, ValueError):
    """A file is not a valid safetensors file (or index) and cannot be imported.

    The message names the file and what is wrong with it. Check that the file
    was fully downloaded; re-export it from its source.
    """


def _safetensors_files(src: str) -> list[str]:
    if os.path.isdir(src):
        index = os.path.join(src, INDEX_FILE)
        if os.path.exists(index):
            src = index
        else:
            found = sorted(
                os.path.join(src, f) for f in os.listdir(src) if f.endswith(".safetensors")
            )
            if not found:
                raise SafetensorsFormatError(f"{src} has no .safetensors file and no {INDEX_FILE}")
            return found
    if src.endswith(".json"):
        try:
            with open(src) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SafetensorsFormatError(f"{src} is not a safetensors index ({e})") from e
        base = os.path.dirname(src)
        return [os.path.join(base, name) for name in dict.fromkeys(weight_map.values())]
    return [src]


def _open_file(path: str) -> tuple[dict[str, Any], np.memmap | None, int]:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsFormatError(f"{path}: too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise SafetensorsFormatError(f"{path}: header length {n} is invalid")
            header = json.loads(f.read(n))
    except OSError as e:
        raise SafetensorsFormatError(f"cannot read {path}: {e.strerror or e}") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise SafetensorsFormatError(f"{path}: the header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise SafetensorsFormatError(f"{path}: the header is not a JSON object")
    start = 8 + n
    data = np.memmap(path, np.uint8, mode="r") if size > start else None
    return header, data, start


def read_safetensors(src: str | os.PathLike[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Yields ``(name, array)`` for every tensor of a file, shard set or directory.

    Arrays are read-only views of memory-mapped files (bfloat16 and float8 via
    ml_dtypes), so nothing is read before it is used.

    Raises:
      SafetensorsFormatError: a file or index is malformed (names the file and tensor).
    """
    for path in _safetensors_files(os.fspath(src)):
        header, data, start = _open_file(path)
        available = 0 if data is None else data.size - start
        for name, info in header.items():
            if name == "__metadata__":
                continue
            where = f"{path}: tensor {name!r}"
            try:
                dtype = np.dtype(_numpy_dtype(info["dtype"], where))
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise SafetensorsFormatError(f"{where}: malformed entry ({e})") from e
            if (
                not 0 <= begin <= end <= available
                or end - begin != math.prod(shape) * dtype.itemsize
            ):
                raise SafetensorsFormatError(
                    f"{where}: data_offsets [{begin}, {end}] do not fit shape {list(shape)} "
                    f"{info['dtype']} in {available} data bytes"
                )
            if data is None or begin == end:
                array = np.zeros(shape, dtype)
            else:
                array = data[start + begin : start + end].view(dtype).reshape(shape)
            yield name, array


def _numpy_dtype(name: str, where: str) -> Any:
    numpy_name = _NUMPY.get(name)
    if numpy_name is None:
        raise SafetensorsFormatError(f"{where}: dtype {name} is not supported")
    if numpy_name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        return getattr(ml_dtypes, numpy_name)
    return numpy_name


def tree_from_names(items: Iterator[tuple[str, Any]] | Sequence[tuple[str, Any]]) -> dict:
    """Nests dotted names into dicts: ``a.b.c`` -> ``{"a": {"b": {"c": ...}}}``.

    >>> tree_from_names([("a.b", 1), ("a.c", 2), ("d", 3)])
    {'a': {'b': 1, 'c': 2}, 'd': 3}

    Raises:
      SafetensorsFormatError: a name is both a tensor and a prefix of another.
    """
    tree: dict[str, Any] = {}
    for name, value in items:
        node = tree
        parts = name.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise SafetensorsFormatError(
                    f"tensor {'.'.join(parts[: i + 1])!r} is also a prefix of {name!r}"
                )
            node = child
        if parts[-1] in node:
            raise SafetensorsFormatError(f"tensor name {name!r} clashes with another tensor")
        node[parts[-1]] = value
    return tree
