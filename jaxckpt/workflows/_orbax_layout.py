"""The layout of an Orbax checkpoint directory, read without jax or Orbax.

Three layouts name the steps and items that :func:`jaxckpt.import_orbax` reads:

* an Orbax ``CheckpointManager`` directory: one directory per committed step
  (``<N>``, zero-padded or ``<prefix>_<N>`` with ``step_prefix``), each holding
  ``_CHECKPOINT_METADATA`` (the handler of every item, metrics, custom
  metadata) and one directory per item (``default``, or a ``Composite``'s names);
* Flax's legacy ``flax.training.checkpoints`` directory: ``checkpoint_<N>``
  directories, each itself one PyTree item;
* one step directory, or one item directory, named directly.

Everything here is read from storage: it is checked, and anything unexpected is
an :class:`~jaxckpt.workflows._import.ImportSourceError` naming the path.
"""

from __future__ import annotations

import json
import operator
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from jaxckpt.workflows._import import ImportSourceError

ItemKind = Literal["tree", "json", "data_iter", "other"]

_STEP_NAME = re.compile(r"^(?:(?P<prefix>.+)_)?(?P<step>\d{1,19})$")
_PROCESS_FILE = re.compile(r"^process_(\d+)-of-(\d+)\.json$")
_CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
_COMMIT_FILE = "commit_success.txt"
_MAX_RECORD_BYTES = 16 << 20  # a JSON record larger than this is not Orbax's


@dataclass(frozen=True, kw_only=True)
class OrbaxItem:
    """One item of a step: its name (None: the step directory is the item), kind, handler."""

    name: str | None
    path: str
    kind: ItemKind
    handler: str | None = None

    @property
    def label(self) -> str:
        return repr(self.name) if self.name is not None else os.path.basename(self.path)


@dataclass(frozen=True, kw_only=True)
class OrbaxStep:
    """A committed Orbax step: its number (None when the path names none) and items."""

    step: int | None
    path: str
    items: tuple[OrbaxItem, ...]
    metrics: dict[str, Any] = field(default_factory=dict)
    custom_metadata: dict[str, Any] = field(default_factory=dict)


def read_json(path: str) -> Any:
    """A small JSON record from storage, or ImportSourceError naming the file."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_RECORD_BYTES + 1)
        if len(data) > _MAX_RECORD_BYTES:
            raise ValueError(f"larger than {_MAX_RECORD_BYTES} bytes")
        return json.loads(data)
    except (OSError, ValueError) as e:
        raise ImportSourceError(f"cannot read {path}: {e}") from e
    except RecursionError:  # json's parser recurses once per level of nesting
        raise ImportSourceError(
            f"cannot read {path}: it is nested too deeply to be Orbax's record"
        ) from None


def _is_tree_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "_METADATA")) or os.path.isfile(
        os.path.join(path, "manifest.ocdbt")
    )


def _is_step_dir(path: str) -> bool:
    """Orbax's record, a PyTree (Flax's layout) or a PyTree item: a step, not other output."""
    if os.path.isfile(os.path.join(path, _CHECKPOINT_METADATA)) or _is_tree_dir(path):
        return True
    return any(_is_tree_dir(e.path) for e in os.scandir(path) if e.is_dir())


def _files(path: str) -> list[str]:
    return sorted(e for e in os.listdir(path) if e != _COMMIT_FILE and not e.startswith("."))


def _kind(path: str, handler: str | None) -> ItemKind:
    """An item's kind: from its handler's type name when Orbax recorded one, else its files.

    A data-iterator state is grain's handler's, or one ``process_<i>-of-<n>.json``
    per process (grain's layout, which other loaders' handlers copy).
    """
    files = _files(path)
    per_process = bool(files) and all(_PROCESS_FILE.match(f) for f in files)
    if handler is not None:
        name = handler.rpartition(".")[2]
        if name in ("StandardCheckpointHandler", "PyTreeCheckpointHandler"):
            return "tree"
        if name == "JsonCheckpointHandler":
            return "json"
        return "data_iter" if handler.startswith("grain.") or per_process else "other"
    if _is_tree_dir(path):
        return "tree"
    if per_process:
        return "data_iter"
    if files == ["metadata"]:  # JsonCheckpointHandler's default file name
        return "json"
    return "other"


def _step_number(path: str) -> int | None:
    match = _STEP_NAME.match(os.path.basename(os.path.normpath(path)))
    return int(match["step"]) if match else None


def _read_step(path: str, step: int | None) -> OrbaxStep:
    """The items of one step directory (Orbax's ``<N>/``, or Flax's ``checkpoint_<N>/``)."""
    record: dict[str, Any] = {}
    meta_path = os.path.join(path, _CHECKPOINT_METADATA)
    if os.path.isfile(meta_path):
        loaded = read_json(meta_path)
        if not isinstance(loaded, dict):
            raise ImportSourceError(f"{meta_path} is not a JSON object")
        record = loaded
    handlers = record.get("item_handlers")
    metrics, custom = record.get("metrics"), record.get("custom_metadata")
    metrics = metrics if isinstance(metrics, dict) else {}
    custom = custom if isinstance(custom, dict) else {}
    if _is_tree_dir(path):  # the step directory is itself one item (Flax's legacy layout)
        handler = handlers if isinstance(handlers, str) else None
        items: tuple[OrbaxItem, ...] = (
            OrbaxItem(name=None, path=path, kind=_kind(path, handler), handler=handler),
        )
    else:
        handlers = handlers if isinstance(handlers, dict) else {}
        names = sorted(
            e for e in os.listdir(path) if os.path.isdir(os.path.join(path, e)) and e[:1] != "."
        )
        items = tuple(
            OrbaxItem(
                name=name,
                path=os.path.join(path, name),
                kind=_kind(os.path.join(path, name), handlers.get(name)),
                handler=handlers.get(name) if isinstance(handlers.get(name), str) else None,
            )
            for name in names
        )
    return OrbaxStep(step=step, path=path, items=items, metrics=metrics, custom_metadata=custom)


def read_source(src: str) -> list[OrbaxStep]:
    """Every committed step ``src`` names, ascending: a manager directory, a step, an item.

    Raises:
      ImportSourceError: ``src`` is none of them, or two step directories carry one number.
    """
    path = os.path.normpath(src)
    if not os.path.isdir(path):
        raise ImportSourceError(f"{src} is not a directory (expected an Orbax checkpoint)")
    if os.path.isfile(os.path.join(path, _CHECKPOINT_METADATA)):  # a step directory
        return [_read_step(path, _step_number(path))]
    if _is_tree_dir(path):  # an item directory named directly: its parent may name the step
        parent = os.path.dirname(path)
        step = _step_number(path)
        step = step if step is not None else _step_number(parent)
        return [
            OrbaxStep(step=step, path=path, items=(OrbaxItem(name=None, path=path, kind="tree"),))
        ]
    entries = sorted(os.listdir(path))
    dirs = {e: _step_number(e) for e in entries if os.path.isdir(os.path.join(path, e))}
    steps = {
        name: n
        for name, n in dirs.items()
        if n is not None and ".orbax" not in name and _is_step_dir(os.path.join(path, name))
    }
    by_number: dict[int, str] = {}
    for name, n in sorted(steps.items()):
        if n in by_number:
            raise ImportSourceError(
                f"{path}: {by_number[n]} and {name} both hold step {n}; import one of them"
            )
        by_number[n] = name
    if by_number:
        return [_read_step(os.path.join(path, by_number[n]), n) for n in sorted(by_number)]
    if any(_is_tree_dir(os.path.join(path, e)) for e in dirs):  # a step without its record
        return [_read_step(path, _step_number(path))]
    legacy = [e for e in entries if _STEP_NAME.match(e) and os.path.isfile(os.path.join(path, e))]
    if legacy:
        raise ImportSourceError(
            f"{path}/{legacy[0]} is a file (Flax's msgpack checkpoint, before Orbax): restore it "
            "with flax.training.checkpoints.restore_checkpoint and save it with jaxckpt"
        )
    raise ImportSourceError(
        f"{src} is not an Orbax checkpoint (no _METADATA, item directory or step directory)"
    )


def choose(src: str, found: list[OrbaxStep], steps: int | Iterable[int] | None) -> list[OrbaxStep]:
    """The steps asked for (None: every one), ascending; a step that is not there is named."""
    if steps is None:
        return found
    wanted = {operator.index(steps)} if not isinstance(steps, Iterable) else set(steps)
    missing = sorted(wanted - {s.step for s in found})
    if missing:
        listed = ", ".join(str(s.step) for s in found)
        raise ImportSourceError(f"{src} has no Orbax step {missing[0]} (its steps: {listed})")
    return [s for s in found if s.step in wanted]
