"""Workflows built on the :class:`~jaxckpt.CheckpointManager`: the resume pre-flight
(:func:`check_resume`), importing safetensors and Orbax checkpoints, exporting to Orbax.

Other packages import from this face only; the ``_modules`` are this package's own
(and its unit tests').
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxckpt._lazy import lazy_names

if TYPE_CHECKING:
    from jaxckpt.workflows._import import ImportSourceError as ImportSourceError
    from jaxckpt.workflows._import import import_safetensors as import_safetensors
    from jaxckpt.workflows._orbax_export import export_orbax as export_orbax
    from jaxckpt.workflows._orbax_import import import_orbax as import_orbax
    from jaxckpt.workflows._preflight import check_resume as check_resume

# Names whose modules import jax or TensorStore load on first use, so that
# the light modules of this package (and ``jaxckpt ls``) stay free of them.
_LAZY = {
    "ImportSourceError": "jaxckpt.workflows._import",
    "import_safetensors": "jaxckpt.workflows._import",
    "export_orbax": "jaxckpt.workflows._orbax_export",
    "import_orbax": "jaxckpt.workflows._orbax_import",
    "check_resume": "jaxckpt.workflows._preflight",
}


__getattr__ = lazy_names(__name__, _LAZY, globals())


__all__ = [
    "ImportSourceError",
    "check_resume",
    "export_orbax",
    "import_orbax",
    "import_safetensors",
]
