"""The ``lowprec`` command and what only it measures, apart from the library (``lowprec.optim``,
``lowprec.recipes``, ``lowprec.memory``, ...), which imports nothing from here.

- ``main``: the console script's ``entry_point``, ``main`` (dispatch), the ``memory`` and
  ``numerics`` commands; ``parser``: the options (argparse); ``compare_cmd``: the compare
  command's progress, table, notes, JSON and plot; ``common``: what the commands share (errors,
  console, JSON); ``plot``: compare's picture (matplotlib).
- ``config``: what the command runs by default and its option checks; ``task``: the built-in
  model and texts; ``run``: one recipe's run on a task; ``pretrained``: the finetune task's
  cached start; ``compare``: every recipe of a task trained in turn, its records; ``summary``:
  what the records mean.
- ``memory_plan`` (``memory --params``), ``memory_peak`` (``memory --measure-peak``) and
  ``memory_probe``, the fresh process it starts (``python -m lowprec.cli.memory_probe``);
  ``demos``: the numerics demonstrations.

This package imports nothing, and ``main``, ``parser``, ``common``, ``compare_cmd`` and ``config``
import no torch: the command's help, its version and a mistyped option answer without the
seconds an import of torch takes; torch is imported once a command runs.
"""
