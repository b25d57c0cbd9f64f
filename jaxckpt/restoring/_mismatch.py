"""A short, diagnosing message for a restore target that does not match the saved tree.

Whatever the tree's size the message stays within about 20 lines: counts, the
first few paths of each kind, the *systematic* differences between saved and
target paths that name the same keys in another form (an attribute ``.params``
where the checkpoint has a dict key ``['params']``, ``.value`` vs
``['value']``, a list index ``[0]`` vs a string key ``['0']``), the ``rename=``
that fixes them (checked by applying it to the saved paths), and
``partial=True`` only when that would make the restore succeed.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Mismatch", "mismatch_message"]

SHOWN = 3  # paths listed per kind
MAX_RENAMES = 8  # rename entries (or replacements) suggested; more need a closer look

_TOKEN = re.compile(r"\.([^.\[\]]+)|\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\]]*)\]")
_INDEX_AS_KEY = (r"\['(\d+)'\]", r"[\1]")
_KEY_AS_INDEX = (r"\[(\d+)\]", r"['\1']")


@dataclass(frozen=True, kw_only=True)
class Mismatch:
    """What :func:`jaxckpt.restoring._match.match_target` found: every path is ``keystr`` text.

    Attributes:
      missing: target paths the checkpoint lacks, with a description of the target leaf.
      extra: saved paths (after ``rename``) the target lacks, with the saved leaf's description.
      shapes: one line per leaf whose shape differs.
      duplicates: one line per target path two saved leaves were renamed to.
      matched: how many target leaves found their saved leaf.
      targets: how many leaves the target has.
      partial: the restore was already partial.
      renamed: a ``rename`` was given.
      unused: saved paths the target lacks when ``partial`` (not an error then, but
        where a rename would find the missing paths).
    """

    missing: Sequence[tuple[str, str]]
    extra: Sequence[tuple[str, str]]
    shapes: Sequence[str]
    duplicates: Sequence[str]
    matched: int
    targets: int
    partial: bool
    renamed: bool
    unused: Sequence[str] = ()


def _tokens(path: str) -> list[str] | None:
    """A keystr path split into its components (``.a``, ``['b']``, ``[0]``), or None."""
    out, at = [], 0
    while at < len(path):
        m = _TOKEN.match(path, at)
        if m is None:
            return None
        out.append(m.group(0))
        at = m.end()
    return out


def _key(token: str) -> str:
    """The key a component names in any form: ``.a``, ``['a']`` -> ``a``; ``[0]`` -> ``0``."""
    if token.startswith("."):
        return token[1:]
    inner = token[1:-1]
    return inner[1:-1] if inner[:1] in "'\"" and len(inner) >= 2 else inner


def _kind(saved: str, target: str) -> str:
    """``dict key vs attribute``, ``string key vs list index`` or ``another form``."""
    forms = {
        "." if t.startswith(".") else "int" if t[1:-1].isdigit() else "key" for t in (saved, target)
    }
    if forms == {"key", "int"}:
        return "string key vs list index"
    if "." in forms:
        return "dict key vs attribute"
    return "another form"


def _fits(rename: Callable[[str], str], missing: set[str], extra: Sequence[str]) -> int:
    """How many missing target paths ``rename`` of the extra saved paths would supply."""
    return len(missing & {rename(p) for p in extra})


def _prefix_rename(pairs: Sequence[tuple[list[str], list[str]]]) -> dict[str, str]:
    """The shortest prefix mapping (saved prefix -> target prefix) of each pair."""
    out: dict[str, str] = {}
    for saved, target in pairs:
        last = max(i for i, (a, b) in enumerate(zip(saved, target, strict=True)) if a != b)
        out["".join(saved[: last + 1])] = "".join(target[: last + 1])
    return out


def _apply_prefixes(mapping: dict[str, str]) -> Callable[[str], str]:
    def rename(path: str) -> str:
        for prefix in sorted(mapping, key=len, reverse=True):
            rest = path[len(prefix) :]
            if path.startswith(prefix) and (not rest or rest[0] in "[."):
                return mapping[prefix] + rest
        return path

    return rename


def _attribute_of(saved: str, target: str) -> bool:
    """Saved ``['name']``, target ``.name`` (a dataclass or namedtuple field, as Orbax
    saves it without a target)."""
    return saved.startswith("['") and target == f".{_key(saved)}" and _key(saved).isidentifier()


def _replacements(token_pairs: Counter[tuple[str, str]]) -> tuple[Callable[[str], str], str]:
    """One callable (and its source text) rewriting every differing component."""
    subs: list[tuple[str, str]] = []
    body = "p"
    index_like = [(a, b) for a, b in token_pairs if _kind(a, b) == "string key vs list index"]
    if index_like:  # one pattern for every index, however many
        pattern, repl = (
            _INDEX_AS_KEY
            if index_like[0][0].startswith("[") and "'" in index_like[0][0]
            else _KEY_AS_INDEX
        )
        subs.append((pattern, repl))
        body = f're.sub(r"{pattern}", r"{repl}", {body})'
    attributes = sorted(
        _key(a) for a, b in token_pairs if _attribute_of(a, b) and (a, b) not in index_like
    )
    if len(attributes) > 1:  # saved ['name'], target .name: one pattern for every name
        pattern = r"\['(" + "|".join(re.escape(n) for n in attributes) + r")'\]"
        repl = r".\1"
        subs.append((pattern, repl))
        body = f're.sub(r"{pattern}", r"{repl}", {body})'
    for a, b in token_pairs:
        if (a, b) not in index_like and not (len(attributes) > 1 and _attribute_of(a, b)):
            subs.append((re.escape(a), b.replace("\\", "\\\\")))
            body = f"{body}.replace({a!r}, {b!r})"

    def rename(path: str) -> str:
        for pattern, repl in subs:
            path = re.sub(pattern, repl, path)
        return path

    return rename, f"rename=lambda p: {body}"


def _suggest(missing: Sequence[str], extra: Sequence[str]) -> tuple[list[str], str | None, int]:
    """Systematic differences (lines), a ``rename=`` that fixes them, and how many it fixes."""
    by_keys: dict[tuple[str, ...], list[str]] = {}
    for path in missing:
        tokens = _tokens(path)
        if tokens is not None:
            by_keys.setdefault(tuple(map(_key, tokens)), []).append(path)
    pairs: list[tuple[list[str], list[str]]] = []
    token_pairs: Counter[tuple[str, str]] = Counter()
    for path in extra:
        tokens = _tokens(path)
        found = by_keys.get(tuple(map(_key, tokens))) if tokens is not None else None
        if tokens is None or not found:
            continue
        target = _tokens(found[0])
        assert target is not None
        pairs.append((tokens, target))
        for a, b in zip(tokens, target, strict=True):
            if a != b:
                token_pairs[(a, b)] += 1
    if not pairs:
        fallback = _suggest_value_suffix(missing, extra)
        return fallback if fallback[1] is not None else _suggest_renamed_keys(missing, extra)
    kinds: Counter[str] = Counter()
    examples: dict[str, tuple[str, str]] = {}
    for (a, b), n in token_pairs.most_common():
        kinds[_kind(a, b)] += n
        examples.setdefault(_kind(a, b), (a, b))
    lines = [
        f"  {len(pairs)} of them name the same keys in another form: "
        + "; ".join(
            f"{kind} (checkpoint {examples[kind][0]}, target {examples[kind][1]})"
            for kind, _ in kinds.most_common(3)
        )
    ]
    wanted = set(missing)
    prefixes = _prefix_rename(pairs)
    candidates: list[tuple[Callable[[str], str], str, int]] = []  # (rename, text, entries)
    if len(prefixes) <= MAX_RENAMES:
        candidates.append((_apply_prefixes(prefixes), f"rename={prefixes!r}", len(prefixes)))
    attrs = sum(_attribute_of(a, b) for a, b in token_pairs)
    collapsed = len(token_pairs) - max(attrs - 1, 0)  # the attributes: one pattern
    if collapsed <= MAX_RENAMES or kinds.keys() == {"string key vs list index"}:
        index_like = [_kind(a, b) == "string key vs list index" for a, b in token_pairs]
        entries = index_like.count(False) + any(index_like) - max(attrs - 1, 0)
        candidates.append((*_replacements(token_pairs), entries))
    # The one that supplies the most missing paths; of those, the shortest.
    best = min(candidates, key=lambda c: (-_fits(c[0], wanted, extra), c[2]), default=None)
    if best is None:
        return lines, None, 0
    fixed = _fits(best[0], wanted, extra)
    return lines, (best[1] if fixed else None), fixed


def _suggest_renamed_keys(
    missing: Sequence[str], extra: Sequence[str]
) -> tuple[list[str], str | None, int]:
    """Saved paths that differ from missing target paths in exactly one key (a renamed
    module or top-level key: saved ``['params']``, target ``['model']``): the prefix
    renames that supply the most missing paths, at most :data:`MAX_RENAMES`."""
    index: dict[tuple[int, int, tuple[str, ...]], list[list[str]]] = {}
    for path in missing:
        tokens = _tokens(path)
        if tokens is None:
            continue
        keys = tuple(map(_key, tokens))
        for i in range(len(keys)):
            index.setdefault((len(keys), i, keys[:i] + keys[i + 1 :]), []).append(tokens)
    counts: Counter[tuple[str, str]] = Counter()
    for path in extra:
        tokens = _tokens(path)
        if tokens is None:
            continue
        keys = tuple(map(_key, tokens))
        for i in range(len(keys)):
            for target in index.get((len(keys), i, keys[:i] + keys[i + 1 :]), ()):
                counts["".join(tokens[: i + 1]), "".join(target[: i + 1])] += 1
    mapping: dict[str, str] = {}
    for (old, new), _ in counts.most_common():
        if old not in mapping and new not in mapping.values() and len(mapping) < MAX_RENAMES:
            mapping[old] = new
    if not mapping:
        return [], None, 0
    fixed = _fits(_apply_prefixes(mapping), set(missing), extra)
    if not fixed:
        return [], None, 0
    line = f"  {fixed} of them are saved under another key (a renamed module or key)"
    return [line], f"rename={mapping!r}", fixed


def _suggest_value_suffix(
    missing: Sequence[str], extra: Sequence[str]
) -> tuple[list[str], str | None, int]:
    """Targets that hold each array in a ``.value`` the checkpoint does not have (an NNX
    state against the pure dict it was saved as): the rename appends ``.value``."""
    suffixed = [p for p in missing if p.endswith(".value")]
    fits = set(extra) & {p[: -len(".value")] for p in suffixed}
    if not fits:
        return [], None, 0
    line = (
        f"  {len(fits)} of them are saved without the target's trailing .value "
        "(a variable's value saved as a plain array)"
    )

    def rename(path: str) -> str:
        return path + ".value" if path in fits else path

    fixed = _fits(rename, set(missing), extra)
    suffix = 'rename=lambda p: p + ".value"'
    if len(fits) < len(extra):  # not every saved leaf: say which ones
        return [line], None, 0
    return [line], suffix, fixed


def _listed(what: str, items: Sequence[str]) -> list[str]:
    more = [f"  ... and {len(items) - SHOWN} more {what}"] if len(items) > SHOWN else []
    return [f"  {x}" for x in items[:SHOWN]] + more


def mismatch_message(m: Mismatch) -> str:
    """The ``TreeMismatchError`` text for ``m``: at most about 20 lines."""
    missing = [p for p, _ in m.missing]
    extra = [p for p, _ in m.extra]
    lines = [
        f"restore target does not match the saved tree: {m.targets} target leaves, "
        f"{m.matched} found in the checkpoint, {len(missing)} not in it, "
        f"{len(extra)} saved leaves not in the target, {len(m.shapes)} shape mismatches"
    ]
    try:
        causes, rename, fixed = _suggest(missing, extra or list(m.unused))
    except Exception:  # a diagnosis must never hide the mismatch itself
        causes, rename, fixed = [], None, 0
    lines += causes
    if rename is not None:
        lines.append(f"  restore(..., {rename}) supplies {fixed} of the {len(missing)} missing")
    lines += _listed("duplicates", m.duplicates)
    lines += _listed(
        "not in checkpoint", [f"not in checkpoint: {p} (target {d})" for p, d in m.missing]
    )
    lines += _listed("not in target", [f"not in target: {p} (saved {d})" for p, d in m.extra])
    lines += _listed("shape mismatches", m.shapes)
    # partial=True ignores saved leaves the target lacks; it helps only if that is all.
    if (
        not m.partial
        and len(extra) > fixed
        and not m.shapes
        and not m.duplicates
        and m.matched + fixed > 0
        and fixed == len(missing)
    ):
        with_rename = " with that rename" if missing else ""
        lines.append(
            f"  restore(..., partial=True){with_rename} restores the target and skips the "
            f"{len(extra) - fixed} saved leaves it lacks"
        )
    return "\n".join(lines)
