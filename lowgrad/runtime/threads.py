"""Ranks as threads of one process: :class:`ThreadCollective`, the rendezvous and mailboxes the
``world`` threads of one group share, and :class:`AbortEvent`, the flag with which
:func:`~lowgrad.run_threads` tells ranks that share nothing else (NCCL's) which rank failed. The
host backend's communicator exchanges its data through the collective; the CUDA loopback
communicator uses it so that ranks on one GPU queue a collective only once every rank has called it.

Failures never hang: an abort wakes every waiting rank with
:class:`~lowgrad.base.errors.CommAbortedError`; a rank that left makes every rank that waits for
it, then or later, raise CommAbortedError naming it at once (what it posted before leaving is
still delivered); a rank that does not arrive within the timeout (``inf``: no limit) gives
:class:`~lowgrad.base.errors.CommTimeoutError` in every waiting rank.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from lowgrad.base.errors import CommAbortedError, CommTimeoutError
from lowgrad.base.integers import integer
from lowgrad.base.timeouts import DEFAULT_TIMEOUT, check_timeout, wait_slice

_MISSING = object()
T = TypeVar("T")


class ThreadCollective:
    """The rendezvous shared by the ``world`` communicators of one group of threads.

    ``exchange`` is an all-to-all of Python objects (every rank gets every rank's item);
    ``post``/``take`` are unbounded FIFO mailboxes per (source, destination, tag). ``timeout``
    (seconds, ``inf`` for no limit, None for the default) is the default of the communicators.
    """

    def __init__(self, world: int, timeout: float | None = DEFAULT_TIMEOUT) -> None:
        world = integer("world", world)
        if world < 1:
            raise ValueError(f"world must be a positive int, got {world!r}")
        self.world, self.timeout = world, check_timeout(timeout)
        self._cv = threading.Condition()
        self._seq = [0] * world
        self._slots: dict[int, list[Any]] = {}  # seq -> [items, arrived, read]
        self._mail: dict[tuple[int, int, str], deque[Any]] = {}
        self._failure: tuple[type[Exception], str] | None = None
        self._left: set[int] = set()  # ranks that closed their communicator
        # what was split from it, aborted with it: held weakly, so that a split whose communicators
        # are all gone (a loopback group holds device memory and streams) does not live on here
        self._children: weakref.WeakSet[Any] = weakref.WeakSet()

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def error(self) -> Exception | None:
        """What every pending and later call of every rank raises once the collective failed (the
        first failure's type and reason), or None."""
        failure = self._failure
        return None if failure is None else failure[0](failure[1])

    def abort(self, reason: str, exc_type: type[Exception] = CommAbortedError) -> None:
        """Fail every pending and later call of every rank with ``exc_type(reason)``; the first
        reason given stays, so that every rank is told the failure that started it."""
        with self._cv:
            if self._failure is None:
                self._failure = (exc_type, reason)
            self._cv.notify_all()
            children = list(self._children)
        for child in children:  # outside the lock: a child's abort takes its own
            child.abort(reason)

    def leave(self, rank: int) -> None:
        """Rank ``rank`` closed its communicator: it will deposit and post nothing more. A rank
        waiting for it (an exchange it never joined, an empty mailbox from it) fails the
        collective with CommAbortedError naming it, now or when it gets there."""
        with self._cv:
            self._left.add(rank)
            self._cv.notify_all()

    def _check_left(self, waiter: int, ranks: list[int], what: str) -> None:
        """Fail the collective when one of ``ranks`` (those ``waiter`` waits for) has left."""
        gone = [r for r in ranks if r in self._left]
        if gone:
            self._fail(CommAbortedError, f"thread collective: rank {waiter} waits for {what} of rank(s) {gone}, "
                       "which left the communicator (close()); aborted")

    def _raise_failure(self) -> None:
        raise self.error()  # type: ignore[misc]  # called once the collective failed

    def _fail(self, exc_type: type[Exception], msg: str) -> None:
        """Fail the collective for every rank and raise (the condition's lock is held)."""
        if self._failure is None:
            self._failure = (exc_type, msg)
        self._cv.notify_all()
        self._raise_failure()

    def exchange(self, rank: int, item: Any, timeout: float) -> list[Any]:
        """Deposit ``item`` and return all ``world`` items in rank order once every rank has."""
        with self._cv:
            if self._failure is not None:
                self._raise_failure()
            seq = self._seq[rank]
            self._seq[rank] = seq + 1
            entry = self._slots.get(seq)
            if entry is None:
                entry = self._slots[seq] = [[_MISSING] * self.world, 0, 0]
            entry[0][rank] = item
            entry[1] += 1
            if entry[1] == self.world:
                self._cv.notify_all()
            deadline = time.monotonic() + timeout
            while entry[1] < self.world:
                if self._failure is not None:
                    self._raise_failure()
                if self._left:
                    self._check_left(rank, _missing(entry[0]), f"collective #{seq}")
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail(CommTimeoutError, f"thread collective: rank {rank} waited {timeout:g} s for rank(s) "
                               f"{_missing(entry[0])} at collective #{seq}; aborted")
                self._cv.wait(wait_slice(left))
            items = entry[0]
            entry[2] += 1
            if entry[2] == self.world:
                del self._slots[seq]
            return items

    def agree(self, rank: int, signature: Any, timeout: float, payload: Any = None) -> list[Any]:
        """:meth:`exchange` ``payload`` and return every rank's in rank order, once every rank's
        ``signature`` (what it is calling: call, dtype, elements, op) was compared: when they
        differ, every rank raises the same ValueError (so nothing is queued on any rank)."""
        items = self.exchange(rank, (signature, payload), timeout)
        if any(sig != items[0][0] for sig, _ in items):
            desc = "; ".join(f"rank {r}: {sig}" for r, (sig, _) in enumerate(items))
            raise ValueError(f"thread collective: ranks disagree on a collective (call, dtype, elements, op): {desc}; "
                             "ranks must make the same calls in the same order")
        return [p for _, p in items]

    def post(self, src: int, dst: int, tag: str, item: Any) -> None:
        """Queue ``item`` from ``src`` for ``dst`` (never blocks)."""
        with self._cv:
            if self._failure is not None:
                self._raise_failure()
            self._mail.setdefault((src, dst, tag), deque()).append(item)
            self._cv.notify_all()

    def take(self, src: int, dst: int, tag: str, timeout: float) -> Any:
        """The next item ``src`` posted for ``dst``; waits at most ``timeout`` seconds."""
        with self._cv:
            q = self._mail.setdefault((src, dst, tag), deque())
            deadline = time.monotonic() + timeout
            while not q:
                if self._failure is not None:
                    self._raise_failure()
                if self._left:
                    self._check_left(dst, [src], "a message")
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail(CommTimeoutError, f"thread collective: rank {dst} waited {timeout:g} s for a message "
                               f"from rank {src}; aborted")
                self._cv.wait(wait_slice(left))
            return q.popleft()

    def split(self, rank: int, color: int, key: int, timeout: float, make: Callable[[int], T]) -> tuple[int, T]:
        """A communicator split over the ranks of this collective (every rank calls it): this rank's
        new rank and what the ranks of its color share, made once by their new rank 0 with
        ``make(size)`` (a :class:`ThreadCollective`, or a group built on one) and handed to the others
        through a second meeting. When ``make`` raises, every rank of that color raises: the maker its
        exception, the others a RuntimeError naming it. What is made is aborted with this collective
        (its ``abort(reason)``): a rank that fails under :func:`~lowgrad.run_threads` wakes the ranks
        waiting in a split communicator too."""
        groups = split_groups(self.agree(rank, ("split",), timeout, (color, key)))
        members = groups[color]
        made: Any = None
        if members[0] == rank:
            try:
                made = make(len(members))
            except Exception as exc:  # noqa: BLE001 - any failure is handed to the peers, then raised here
                made = exc
        if members[0] == rank and not isinstance(made, Exception):
            with self._cv:
                self._children.add(made)
        shared = self.exchange(rank, made, timeout)[members[0]]
        if isinstance(shared, Exception):
            if members[0] == rank:
                raise shared
            raise RuntimeError(f"split: rank {members[0]} could not create the new communicator of color {color}: "
                               f"{type(shared).__name__}: {shared}")
        return members.index(rank), shared


def split_groups(colors_keys: Sequence[tuple[int, int]]) -> dict[int, list[int]]:
    """Each color's ranks in their new order, by (key, rank): what a communicator split makes of
    every rank's ``(color, key)``."""
    groups: dict[int, list[int]] = {}
    for r in sorted(range(len(colors_keys)), key=lambda r: (colors_keys[r][1], r)):
        groups.setdefault(colors_keys[r][0], []).append(r)
    return groups


class AbortEvent(threading.Event):
    """A ``threading.Event`` that keeps why it was set. :func:`~lowgrad.run_threads` hands it to
    NCCL communicators, which share no collective that could carry the reason: a rank watching it
    raises CommAbortedError with the reason of the first :meth:`abort` (the failure that started it)."""

    def __init__(self) -> None:
        super().__init__()
        self._reason_lock = threading.Lock()
        self.reason: str | None = None

    def abort(self, reason: str) -> None:
        """Set the event; the first reason given stays."""
        with self._reason_lock:
            if self.reason is None:
                self.reason = reason
        self.set()


def _missing(items: list[Any]) -> list[int]:
    return [r for r, x in enumerate(items) if x is _MISSING]
