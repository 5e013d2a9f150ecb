"""Thin adapters between lowprec and training frameworks, one module per framework.

Each adapter imports its framework when it is itself imported, never here, so ``import lowprec``
and ``import lowprec.integrations`` work without any framework installed:

* ``lowprec.integrations.lightning``: ``MixedPrecision``, a Lightning precision plugin that lets
  loss scaling and gradient clipping work together with lowprec's optimizers
  (``pip install "lowprec[integrations]"`` or ``pip install lightning``).
"""
