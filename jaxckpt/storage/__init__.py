"""Checkpoint roots: the storage interface and its backends."""

from __future__ import annotations

from jaxckpt.storage._local import LocalStorage as LocalStorage
from jaxckpt.storage._local import PreconditionFailed as PreconditionFailed
from jaxckpt.storage._local import Storage as Storage
from jaxckpt.storage._local import aligned_empty as aligned_empty
from jaxckpt.storage._local import open_storage as open_storage
