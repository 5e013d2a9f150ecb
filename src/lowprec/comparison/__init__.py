"""Recipes compared on a task: ``lowprec.compare`` (``api``) and the parts under it.

``config`` (the options and their checks, no torch: the command's ``--help`` imports it),
``task`` (what a comparison trains: a model, batches and a loss; the built-in byte-level tasks),
``run`` (one recipe's run), ``compare`` (every recipe and seed, the recipes' steps in turn),
``summary`` (what the records mean, torch-free), ``pretrained`` (the fine-tuning task's start)
and ``plot``. This package's own module imports nothing, so that importing ``config`` stays
light.
"""
