"""``dynarl``: the command-line client of the dynarl REST API (see docs/cli.md)."""
