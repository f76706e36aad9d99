"""What the two communicators of the CUDA backend share (NCCL's
:class:`~lowgrad.cuda.communicator.Communicator` and
:class:`~lowgrad.cuda.loopback.LoopbackCommunicator`): :class:`GpuCommBase`, the stream a call
runs on, the polling :meth:`~GpuCommBase.wait` and its timeout, and :meth:`~GpuCommBase.host_allgather`
through a device all-gather. Each backend fills three narrow hooks: one round of watching for
failures (:meth:`~GpuCommBase._watch`), the failure its ranks share
(:meth:`~GpuCommBase._failure`) and the device buffer and stream of the host-side helpers
(:meth:`~GpuCommBase._host_buffer`, :meth:`~GpuCommBase._host_gather`).
"""
from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from lowgrad.base.errors import CommTimeoutError
from lowgrad.base.timeouts import check_timeout
from lowgrad.buffers import capture
from lowgrad.buffers.streams import StreamLike, stream_handle
from lowgrad.buffers.tensor import Tensor
from lowgrad.contracts.communicator import CommBase

_POLL_MIN, _POLL_MAX = 20e-6, 2e-3  # seconds between polls (doubling): quick for short waits, cheap for long


class GpuCommBase(CommBase):
    """The half of a CUDA communicator that does not depend on how the ranks meet."""

    #: how the timeout message names the communicator after "rank r of W"
    _label = ""

    # ---- hooks -------------------------------------------------------------------------
    @abstractmethod
    def _watch(self, call: str) -> None:
        """One round of a poll: raise what went wrong (aborting this rank first where the backend
        must), return when nothing did."""

    @abstractmethod
    def _failure(self) -> Exception | None:
        """Why the ranks' group failed, where something shared knows it (run_threads' reason), or
        None: an aborted communicator raises it instead of a bare "was aborted"."""

    @abstractmethod
    def _host_buffer(self, name: str, nbytes: int) -> AbstractContextManager[Tensor]:
        """A device buffer of ``nbytes`` for the host-side helpers, for the ``with`` block."""

    @abstractmethod
    def _host_gather(self, buf: Tensor) -> None:
        """All-gather ``buf`` in place and block until it is done."""

    # ---- shared ------------------------------------------------------------------------
    def _check_open(self, call: str) -> None:
        why = self._failure() if self._state == "aborted" else None
        if why is not None:  # the reason the group failed, not just "aborted"
            raise why
        super()._check_open(call)

    def _stream(self, stream: StreamLike) -> int:
        """The raw handle a collective runs on: ``stream``, or inside :meth:`group` with
        ``stream=None`` the group's stream."""
        if stream is None and self._group is not None:
            return stream_handle(self._group.stream)
        return stream_handle(stream)

    def _poll(self, call: str, limit: float, done: Callable[[], bool]) -> None:
        """Until ``done()`` (which raises what went wrong); ``limit`` seconds passing aborts the
        communicator and raises CommTimeoutError."""
        deadline, pause = time.monotonic() + limit, _POLL_MIN
        while not done():
            if time.monotonic() > deadline:
                self.abort()
                raise CommTimeoutError(f"{call}: rank {self.rank} of {self.world}{self._label} did not complete "
                                       f"within {limit:g} s; communicator aborted")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)

    def wait(self, what: Any = None, timeout: float | None = None) -> None:
        """Block until ``what`` (an Event, a Stream, a raw stream handle, or None for the default
        stream) has completed, watching for failures: an asynchronous error, an abort, a departed
        peer raise (CommAbortedError, or the backend's error); ``timeout`` seconds (``inf`` for no
        limit; default: the communicator's) passing aborts the communicator and raises
        CommTimeoutError."""
        limit = check_timeout(timeout, self.timeout)
        self._check_open("wait")
        capture.forbid(f"{type(self).__name__}.wait (a host sync)")
        self.device.activate()
        target = what if hasattr(what, "query") else self.device.resolve_stream(what)

        def done() -> bool:
            finished = target.query()
            self._watch("wait")  # after the look: a failure can let the device work finish undone
            return finished
        self._poll("wait", limit, done)

    def host_allgather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` in rank order, on every rank: two device all-gathers (the lengths,
        then the data padded to the longest) through a device buffer; blocking, bounded by
        ``timeout``."""
        self._check_open("host_allgather")
        self._check_not_grouped("host_allgather")
        data = self._check_bytes("host_allgather", data)
        sizes = [int.from_bytes(x, "little") for x in self._gather_fixed("lengths", len(data).to_bytes(8, "little"),
                                                                          8)]
        blobs = self._gather_fixed("blobs", data, max(max(sizes), 1))
        return [b[:n] for b, n in zip(blobs, sizes)]

    def _gather_fixed(self, name: str, data: bytes, size: int) -> list[bytes]:
        """Every rank's ``data`` (at most ``size`` bytes), each padded to ``size``."""
        with self._host_buffer(name, size * self.world) as buf:
            host = np.zeros(size * self.world, np.uint8)
            host[self.rank * size:self.rank * size + len(data)] = np.frombuffer(data, np.uint8)
            self.device.copy_from_host(buf, host)
            self._host_gather(buf)
            out = buf.numpy().tobytes()
        return [out[r * size:(r + 1) * size] for r in range(self.world)]
