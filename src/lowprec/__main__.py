"""``python -m lowprec``: the same as the ``lowprec`` command."""

from lowprec.cli.main import entry_point

entry_point()
