"""Every object of one save attempt: listed and removed, hashed prefixes included.

An attempt's records and plain-layout arrays lie under ``attempts/<step>/<attempt>/``;
from format 4 its packs and manifest parts lie under hashed prefixes
``data/<hh>/<step>.<attempt>/`` (see :mod:`jaxckpt.records._keys`). A lister visits
the attempt's prefix and the hashed prefixes its objects can be under: those of the
names it expects, else the attempt's 32 (whatever its number of processes), in
parallel, 16 listings at once.
Imports no jax.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from jaxckpt import _pools as pools
from jaxckpt.records import StepLocation, spread_slot
from jaxckpt.storage import Storage

LISTINGS_IN_FLIGHT = 16


def attempt_prefixes(loc: StepLocation, names: Iterable[str] | None = None) -> list[str]:
    """The prefixes that hold ``loc``'s objects (see :meth:`StepLocation.buckets`).

    With ``names``, only the prefixes of those objects (the attempt's own prefix only
    if one of them is not spread).
    """
    if names is not None:
        names = list(names)
        spread = loc.is_spread
        own = [loc.prefix] if any(not spread or spread_slot(n) is None for n in names) else []
        return own + [loc.bucket_prefix(b) for b in loc.buckets(names=names)]
    return [loc.prefix] + [loc.bucket_prefix(b) for b in loc.buckets()]


def list_attempt(
    storage: Storage,
    loc: StepLocation,
    names: Iterable[str] | None = None,
    *,
    listed: Collection[str] = (),
) -> list[str]:
    """Every key of ``loc`` (or, with ``names``, the keys under those names' prefixes),
    sorted: one listing per prefix, 16 at once, except the prefixes in ``listed``."""
    prefixes = [p for p in attempt_prefixes(loc, names) if p not in listed]
    return list_prefixes(storage, prefixes)


def list_prefixes(storage: Storage, prefixes: Sequence[str]) -> list[str]:
    """Every key under ``prefixes``, sorted: one listing each, 16 at once."""
    if not prefixes:
        return []
    if len(prefixes) == 1:
        return storage.list(prefixes[0])
    with pools.borrow("attempt-listing", LISTINGS_IN_FLIGHT) as pool:
        found = list(pool.map(storage.list, prefixes))
    return sorted(key for keys in found for key in keys)


def remove_attempt(storage: Storage, loc: StepLocation) -> bool:
    """Deletes every object of ``loc``; True once a listing shows none left.

    Requests: one listing per prefix (16 at once), then every key found in one
    :meth:`Storage.delete_many` (S3: ``DeleteObjects`` of up to 1,000 keys each), then
    :meth:`Storage.delete_prefix` of each prefix that held keys (on a local root it
    removes the emptied directories; on an object store it finds nothing unless a
    writer refilled it), then one listing per prefix again: every prefix for a
    partial attempt (its writer may still be writing), only those that held keys for
    a committed one (nobody writes into it). False: a writer still writing refilled
    it (the caller keeps its pending record for the next collection).
    """
    prefixes = attempt_prefixes(loc)
    with pools.borrow("attempt-listing", LISTINGS_IN_FLIGHT) as pool:
        found = list(pool.map(storage.list, prefixes))
        storage.delete_many([key for keys in found for key in keys])
        held = [prefix for prefix, keys in zip(prefixes, found, strict=True) if keys]
        list(pool.map(storage.delete_prefix, held))
        left = list(pool.map(storage.list, held if loc.sealed else prefixes))
    return not any(left)
