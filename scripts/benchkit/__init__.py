"""The pieces of ``scripts/bench.py``, one module per job.

* ``common``: cases, settings, constants; ``contenders``: raw / jaxckpt / Orbax savers;
* ``measure``: what a child process measures; ``rounds``: children, scratch, interleaving;
* ``summary``: medians and targets; ``machine``: what it ran on;
* ``stores``: loopback S3/GCS servers; ``report``: markdown, chart, JSON.
"""
