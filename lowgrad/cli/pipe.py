"""A command whose reader goes away ends quietly: ``lowgrad doctor | head -1``, ``python3
tools/accuracy.py | head -1``. The one rule for the ``lowgrad`` command, every tool in tools/ and
every example (they call it through tools/_cli.py's ``run``)."""
from __future__ import annotations

import os
import select
import signal
import sys
from collections.abc import Callable

#: the status a shell reports for a command that a closed pipe ended (128 + SIGPIPE)
CLOSED_PIPE = 128 + signal.SIGPIPE


def quiet_on_closed_pipe(body: Callable[[], int]) -> int:
    """``body()``'s exit status, or :data:`CLOSED_PIPE` without a traceback when stdout's reader
    went away before all of the output was written.

    Python's recipe (the ``signal`` module's notes on SIGPIPE): stdout is pointed at devnull, so
    that the interpreter's last flush does not raise again. SIGPIPE itself keeps Python's
    disposition: a socket of a rendezvous that breaks is an error, and is reported as one (a
    BrokenPipeError while stdout is fine propagates)."""
    try:
        status = body()
        sys.stdout.flush()  # inside the try: a block-buffered pipe fails here, not at exit
    except BrokenPipeError:
        if not stdout_closed():
            raise  # another pipe or socket broke: not the reader of stdout going away
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CLOSED_PIPE
    return status


def stdout_closed() -> bool:
    """Whether stdout's reader is gone: poll reports an error or hang-up on the writing end of a
    pipe whose reading end was closed (a zero-byte write would not tell, it succeeds)."""
    poll = select.poll()
    poll.register(sys.stdout.fileno(), select.POLLOUT)
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))
