"""The ``pathir`` command line: one module per subcommand in pathir/commands/.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Errors a user can cause print one clear line on stderr and
exit with status 2; nothing is written on failure.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pathir.errors import PathirError

__all__ = ["main", "COMMANDS"]

#: subcommand name -> module under pathir.commands
COMMANDS = {
    "summary": "summary",
    "pathcond": "pathcond",
    "enorm": "enorm",
    "prune": "prune",
    "demo": "demo",
    "observe": "observe",
}


def _parser(modules) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pathir", description="ReLU networks with their rescaling symmetries factored out.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, mod in modules.items():
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
    return parser


def _load() -> dict:
    """Every listed command's module (a missing one is a bug, not a command to hide)."""
    return {name: importlib.import_module(f"pathir.commands.{module}") for name, module in COMMANDS.items()}


def main(argv=None) -> int:
    modules = _load()
    args = _parser(modules).parse_args(argv)
    try:
        return int(modules[args.command].run(args) or 0)
    except (PathirError, FileNotFoundError, ValueError) as err:
        print(f"pathir {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
