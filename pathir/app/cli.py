"""The ``pathir`` command line: one module per subcommand in pathir/commands/.

Each command module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Errors a user can cause print one clear line on stderr and
exit with status 2; nothing is written on failure. A reader that closes the pipe
before the command writes (``pathir summary resnet18 --json | true``) ends the command
quietly with status 141, as a tool killed by SIGPIPE; Ctrl-C with 130. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from pathir import __version__
from pathir.errors import PathirError
from pathir.support.progress import close_all

__all__ = ["main", "COMMANDS"]

#: subcommand name -> module under pathir.app.commands
COMMANDS = {
    "summary": "summary",
    "check": "check",
    "pathcond": "pathcond",
    "enorm": "enorm",
    "equalize": "equalize",
    "prune": "prune",
    "demo": "demo",
    "observe": "observe",
}


def _parser(modules) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pathir", description="ReLU networks with their rescaling symmetries factored out.")
    parser.add_argument("--version", action="version", version=f"pathir {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, mod in modules.items():
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
    return parser


def _load() -> dict:
    """Every listed command's module (a missing one is a bug, not a command to hide)."""
    return {name: importlib.import_module(f"pathir.app.commands.{module}") for name, module in COMMANDS.items()}


def main(argv=None) -> int:
    modules = _load()
    args = _parser(modules).parse_args(argv)
    try:
        code = int(modules[args.command].run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the try
        return code
    except BrokenPipeError:
        _silence_stdout()
        return 141
    except KeyboardInterrupt:
        close_all()
        print(f"pathir {args.command}: interrupted", file=sys.stderr)
        return 130
    except (PathirError, OSError, ValueError) as err:  # OSError: a file that cannot be read or written
        close_all()  # a bar the failing call left drawn goes before the error line
        print(f"pathir {args.command}: error: {err}", file=sys.stderr)
        return 2


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (a test's capture)
        pass


def entry() -> None:
    """The ``pathir`` command: :func:`main`, then exit with its status. A process a launcher started (torchrun sets
    WORLD_SIZE) leaves once its output is flushed, without the interpreter's teardown, where gloo's threads and
    torch's were torn down in an order that aborted in C++ ("terminate called without an active exception") about
    one run in sixteen: torchrun's exit status 1 after the whole table was written."""
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: its reader is gone
                pass
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
