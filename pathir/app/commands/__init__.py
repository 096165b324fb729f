"""Subcommands of the ``pathir`` CLI (see pathir.app.cli)."""
