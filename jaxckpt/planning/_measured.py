"""The default counts of ``jaxckpt plan --processes``: those of the current format, measured.

``scale_counts.json`` beside this module is the report of a run of real JAX processes
saving and restoring one step (``python scripts/bench.py scale --json``), shipped with
the package and fit by :func:`jaxckpt.planning._profiles.fit_profile`. Regenerate it
whenever what a save or a restore sends changes::

    python scripts/bench.py scale --processes 2,4,8 --json jaxckpt/planning/scale_counts.json

Pure: no jax; the file is read on first use, not at import.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources

from jaxckpt.planning._profiles import PROFILES, Profile, fit_profile
from jaxckpt.records import SPREAD_SLOTS

__all__ = ["MEASURED", "REPORT", "measured_profile", "named_profiles"]

MEASURED = "measured"
REPORT = "scale_counts.json"


@functools.cache
def measured_profile() -> Profile:
    """The profile fit to the shipped report of the current format.

    The primary's save reads grow with N only by the hashed prefixes its commit lists,
    one per slot the processes' parts and packs used: they stop at
    :data:`SPREAD_SLOTS`, where a fit to a few processes would go on growing.
    """
    report = json.loads(resources.files(__package__).joinpath(REPORT).read_text())
    profile = fit_profile(report, name=MEASURED)
    primary = dict(profile.formulas["save"]["primary"])
    primary["meta_reads"] = dataclasses.replace(primary["meta_reads"], until=SPREAD_SLOTS)
    save = {**profile.formulas["save"], "primary": primary}
    return dataclasses.replace(
        profile,
        formulas={**profile.formulas, "save": save},
        source=f"the current format's counts, measured: {profile.source} "
        f"(jaxckpt/planning/{REPORT}, from `python scripts/bench.py scale --json`); the "
        f"primary's save listings stop growing at {SPREAD_SLOTS} hashed prefixes",
    )


def named_profiles() -> dict[str, Profile]:
    """Every profile ``--counts`` names: the measured one (the default) and the comparisons."""
    return {MEASURED: measured_profile(), **PROFILES}
