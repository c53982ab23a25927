"""The `freqact` command line: one parser function and one handler per subcommand.

Handlers only translate arguments into one library call and print where results went.
Expected errors (bad arguments, missing files) become one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

# Each entry: (name, help, add_arguments(parser), handler(args) -> int).
Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _commands() -> list[Command]:
    """The registered subcommands, in the order `freqact --help` lists them."""
    return []


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand attached."""
    from freqact import __version__

    parser = argparse.ArgumentParser(
        prog="freqact",
        description="Activation maps in the frequency domain and training with compressed "
        "activations (DIVISION).",
    )
    parser.add_argument("--version", action="version", version=f"freqact {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text, add_arguments, handler in _commands():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(cmd)
        cmd.set_defaults(handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `freqact` with `argv` (default: sys.argv[1:]); return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 0
    try:
        return int(args.handler(args) or 0)
    except (ValueError, TypeError, FileNotFoundError, PermissionError, KeyError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"freqact {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
