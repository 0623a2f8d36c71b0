"""``python -m conveyor_cli``: the same as the ``conveyor`` command."""

from conveyor_cli.main import cli

cli()
