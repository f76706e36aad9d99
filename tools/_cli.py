"""What every script in tools/ shares: it runs, or it says why it cannot in one line on stderr
and exits with status 2 (no traceback), on a machine with a GPU and on one without.

- :class:`Parser`: argparse with one-line errors (``tool: error: ... (see --help)``, status 2);
  :func:`int_at_least` parses a bounded integer, :func:`int_list` and :func:`float_list` comma
  lists.
- :func:`require_cuda`: by capability (lowgrad's own driver check, the GPU count), not by a
  backend's name: :class:`CannotRun` with ``needs an NVIDIA GPU and driver (CUDA backend):
  <reason>`` and, for a tool with a host mode, how to use it.
- :func:`run`: calls a tool's ``main`` and turns :class:`CannotRun`, a
  ``CudaUnavailableError`` raised where no check came first (a rank's thread, say) and a missing
  NCCL library into that one line and status 2. Every other exception is a bug and keeps its
  traceback, except stdout's reader going away (``tool | head -1``): the tool ends quietly with
  status 141, as the ``lowgrad`` command does (``lowgrad.cli.pipe``, the one rule for both).
- :func:`output_path`: the one rule for where a tool or example writes when the user names no
  path: ``$OUT/NAME`` when ``OUT`` is set, else ``./NAME`` in the current directory, but never the
  repository's own root (a run from there writes to ``<tmp>/lowgrad-tools/NAME``); each one
  prints where it wrote.

A tool imports it as ``from _cli import ...`` once tools/ is on ``sys.path`` (as predict_scaling
imports bench_manager). Two commands give the shell scripts the same rules:
``python3 tools/_cli.py needs-gpu NAME [HINT]`` is the GPU check (silent with status 0 where there
is a GPU, else the one line and status 2), and ``python3 tools/_cli.py output-path TOOL NAME
[GIVEN...]`` prints :func:`output_path` of ``NAME`` (``GIVEN``: the script's own arguments, at most
one folder, used when not empty; an option or a second argument is the one line ``TOOL: error:
unrecognized arguments: ... (see --help)`` and status 2, as :class:`Parser` says it).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # a checkout that is not installed: the lowgrad next to tools/
    sys.path.insert(1, REPO)

CANNOT_RUN = 2  # the exit status of "cannot run here": the same as argparse's for a bad argument
INSTALL = 'pip install ".[cu12]" from the repository, or run the tool with the Python lowgrad is installed in'

try:  # every tool needs lowgrad: without it (or its dependencies) in this Python, one line
    import lowgrad
except ImportError as _exc:
    _name = sys.argv[2] if sys.argv[1:2] in (["needs-gpu"], ["output-path"]) and len(sys.argv) > 2 else \
        os.path.splitext(os.path.basename(sys.argv[0]))[0]
    print(f"{_name}: needs lowgrad and its dependencies in this Python ({_exc}): {INSTALL}", file=sys.stderr)
    sys.exit(CANNOT_RUN)


class CannotRun(Exception):
    """This tool cannot run with this setup (no GPU, too few GPUs, a missing input, arguments that
    do not fit together); the message is the line the user reads."""


def one_line(text: str) -> str:
    """``text`` on one line (an exception's message can span several)."""
    return " ".join(text.split())


def say(tool: str, message: str) -> int:
    """Print ``tool: message`` as one line on stderr; the exit status :data:`CANNOT_RUN`."""
    print(f"{tool}: {one_line(message)}", file=sys.stderr, flush=True)
    return CANNOT_RUN


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line: ``tool: error: MESSAGE (see --help)``, status 2."""

    def __init__(self, tool: str, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.tool = tool

    def error(self, message: str) -> NoReturn:
        self.exit(CANNOT_RUN, f"{self.tool}: error: {one_line(message)} (see --help)\n")

    def parse_known_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> tuple[Any, list[str]]:
        """argparse's, but an argument the tool does not know is named before a required one that
        is missing (argparse checks the required ones first: ``grad_report.py --bogus`` would say
        that ``--log`` is missing, not that ``--bogus`` is unknown). A first pass with nothing
        required finds the unknown ones."""
        args = None if args is None else list(args)  # read twice
        required = [action for action in self._actions if action.required]
        if required:
            for action in required:
                action.required = False
            try:
                extra = super().parse_known_args(args, argparse.Namespace())[1]
            finally:
                for action in required:
                    action.required = True
            if extra:
                self.error(f"unrecognized arguments: {' '.join(extra)}")
        return super().parse_known_args(args, namespace)


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: one integer of at least ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def int_list(low: int = 1) -> Callable[[str], list[int]]:
    """An argparse ``type``: a comma list of integers, each at least ``low``."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
        if not values or min(values) < low:
            raise argparse.ArgumentTypeError(f"expected integers of at least {low}, got {text!r}")
        return values
    return parse


def float_list(text: str) -> list[float]:
    """An argparse ``type``: a comma list of finite numbers."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected finite numbers, got {text!r}")
    return values


PLOT_EXTRA = 'pip install ".[plot]" (or pip install matplotlib)'


def has_matplotlib() -> bool:
    """Whether matplotlib (the plot extra) imports here."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def require_matplotlib(what: str = "needs matplotlib") -> None:
    """:class:`CannotRun` (``what`` and how to install it) unless matplotlib imports: a tool that
    was asked for a plot checks before it runs, not after."""
    if not has_matplotlib():
        raise CannotRun(f"{what}: {PLOT_EXTRA}")


def needs_gpu(reason: str, host_hint: str | None = None) -> str:
    """The line for a missing GPU, with how to run without one where the tool can."""
    text = f"needs an NVIDIA GPU and driver (CUDA backend): {reason}"
    return f"{text}; without one: {host_hint}" if host_hint else text


def cuda_reason() -> str | None:
    """Why the CUDA backend cannot run here (lowgrad's driver check), or None where it can."""
    from lowgrad.cuda import driver

    return driver.unavailable_reason()


def require_cuda(gpus: int = 1, host_hint: str | None = None) -> None:
    """:class:`CannotRun` unless the CUDA backend works here with at least ``gpus`` GPUs."""
    from lowgrad.cuda.device import device_count

    reason = cuda_reason()
    count = 0 if reason else device_count()
    if count == 0:
        raise CannotRun(needs_gpu(reason or "no GPU visible", host_hint))
    if count < gpus:
        raise CannotRun(f"needs {gpus} GPUs, {count} visible")


def output_path(name: str, given: str | None = None) -> str:
    """Where to write ``name``: ``given`` (the user's ``--json``); else ``$OUT/NAME``; else
    ``./NAME``, or ``<tmp>/lowgrad-tools/NAME`` when the current directory is the repository's
    root (results do not go among the sources). The folder must exist (made for the temporary
    one): :class:`CannotRun` otherwise, before anything runs."""
    if given:
        path = given
    elif os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], name)
    elif os.path.realpath(os.getcwd()) == os.path.realpath(REPO):
        folder = os.path.join(tempfile.gettempdir(), "lowgrad-tools")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, name)
    else:
        path = os.path.join(os.getcwd(), name)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CannotRun(f"cannot write {path}: no such directory {folder}")
    return path


def output_help(name: str) -> str:
    """The ``--json`` help text that goes with :func:`output_path`."""
    return (f"write the results here (default: $OUT/{name} when OUT is set, else ./{name}; from the "
            f"repository's root, {os.path.join(tempfile.gettempdir(), 'lowgrad-tools', name)})")


def load_layout(config: str, option: str = "--config") -> lowgrad.Layout:
    """``lowgrad.llama_layout(config)``, a bad name or file being :class:`CannotRun` that names
    ``option``."""
    import lowgrad as lg

    try:
        return lg.llama_layout(config)
    except (ValueError, OSError) as exc:
        raise CannotRun(f"{option}: {exc}") from None


def check_world(layout: object, world: int, what: str = "--world") -> None:
    """:class:`CannotRun` when ``layout`` does not shard over ``world`` ranks."""
    try:
        layout.check_world(world)  # type: ignore[attr-defined]
    except ValueError as exc:
        raise CannotRun(f"{what} {world}: {exc}") from None


def run(tool: str, main: Callable[[], int]) -> int:
    """``main()``'s exit status, or :data:`CANNOT_RUN` after one line on stderr when it cannot
    run here, or 141 without a word when stdout's reader went away (see the module's
    docstring)."""
    from lowgrad.base.errors import CudaUnavailableError, NcclLibraryError
    from lowgrad.cli.pipe import quiet_on_closed_pipe

    def body() -> int:
        try:
            return main()
        except CannotRun as exc:
            return say(tool, str(exc))
        except CudaUnavailableError as exc:
            return say(tool, needs_gpu(str(exc)))
        except NcclLibraryError as exc:
            return say(tool, f"needs the NCCL library: {exc}")

    return quiet_on_closed_pipe(body)


def _main(argv: list[str]) -> int:
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    required = {"needs-gpu": 1, "output-path": 2}.get(command)
    if required is None or len(args) < required or command == "needs-gpu" and len(args) > required + 1:
        print("usage: python3 tools/_cli.py needs-gpu NAME [HINT] | output-path TOOL NAME [GIVEN...]", file=sys.stderr)
        return CANNOT_RUN
    extra = args[required] if len(args) > required else None  # HINT or GIVEN

    def check() -> int:
        require_cuda(host_hint=extra)
        return 0

    def path() -> int:
        given = args[2:]  # the script's own arguments: at most one, a folder
        unknown = given[1:] if given[:1] and not given[0].startswith("-") else given
        if unknown:
            raise CannotRun(f"error: unrecognized arguments: {' '.join(unknown)} (see --help)")
        print(output_path(args[1], extra))
        return 0

    return run(args[0], check if command == "needs-gpu" else path)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
