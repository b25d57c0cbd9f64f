"""``python -m jaxckpt``: the same command line as the ``jaxckpt`` console script."""

from __future__ import annotations

import sys

from jaxckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
