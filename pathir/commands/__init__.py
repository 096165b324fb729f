"""Subcommands of the ``pathir`` CLI (see pathir.cli)."""
