"""The ``lowgrad`` command line (also ``python -m lowgrad``): subcommands ``demo`` and ``doctor``,
``--version``. Descriptions are plain text; the program name is the one the user typed."""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from typing import Any, NoReturn

from lowgrad.base.version import __version__
from lowgrad.cli import demo, doctor
from lowgrad.cli.pipe import quiet_on_closed_pipe

_MAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "__main__.py")
DESCRIPTION = """\
lowgrad manages weight gradients of large models on NVIDIA GPUs: stochastic-rounding
accumulation into bf16, ZeRO-style sharding, pinned offload and NCCL. Without a GPU the
host backend (numpy, threads as ranks) runs the same code. Run "doctor" first."""


def prog_name(argv0: str | None = None) -> str:
    """How the user invoked lowgrad: ``<python> -m lowgrad`` when ``argv0`` (default
    ``sys.argv[0]``) is this package's ``__main__.py``, else ``lowgrad``."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    if os.path.realpath(argv0) == _MAIN:
        python = os.path.basename(getattr(sys, "orig_argv", [""])[0]) or "python"
        return f"{python} -m lowgrad"
    return "lowgrad"


class Parser(argparse.ArgumentParser):
    """An argument error is one line on stderr, ``<prog>: error: <message>``, and exit status 2
    (docs/cli.md), where argparse prints the usage first; ``--help`` still prints it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class Command(Parser):
    """A subcommand's parser: an argument it does not know is its error, naming it (argparse
    would hand it up to the top-level parser, which then blames ``lowgrad`` itself)."""

    def parse_known_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> tuple[Any, list[str]]:
        parsed, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed, extra


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; ``prog`` defaults to :func:`prog_name`."""
    p = Parser(prog=prog_name() if prog is None else prog, description=DESCRIPTION,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(title="commands", dest="command", required=True, metavar="{doctor,demo}",
                           parser_class=Command)
    for name, module in (("doctor", doctor), ("demo", demo)):
        cmd = sub.add_parser(name, help=module.SUMMARY, description=module.DESCRIPTION,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(cmd)
        cmd.set_defaults(run=module.run, prog=cmd.prog)
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the command; its exit status.

    A reader that closes stdout early (``lowgrad doctor | head -1``) ends the command quietly
    with 141, the status a shell gives a command that SIGPIPE ended
    (:func:`lowgrad.cli.pipe.quiet_on_closed_pipe`)."""
    args = parser(prog).parse_args(argv)
    return quiet_on_closed_pipe(lambda: int(args.run(args)))
