"""The pieces of ``scripts/bench.py``, one module per job.

* ``common``: cases, settings, constants; ``contenders``: raw / jaxckpt / Orbax savers;
* ``measure``: what a child process measures; ``rounds``: children, scratch, interleaving;
* ``summary``: medians and targets; ``machine``: what it ran on;
* ``servers``: the loopback S3 (moto) and GCS emulator servers, shared with the test suite;
* ``stores``: the object-store rows on those servers;
  ``report``: markdown, chart, JSON.

The other benchmarks, each a ``bench.py`` subcommand with ``main(argv)``:
``tiers``, ``packed``, ``replread``, ``listing``; ``suite`` is ``bench.py all``.
Groups of real JAX processes (``scale_child`` each, run by ``group``): ``scale``,
``storm`` (60 s of ``503 SlowDown``) and ``denied`` (one host's data answered 403).
"""
