"""lowgrad's exception family: one root, :class:`LowgradError`, every class exported from ``lowgrad``.

Every CUDA driver, NVRTC and NCCL failure raises a subclass that names the call, the error name
and the library's message; a closed object, a forbidden operation during capture and a
gradient-manager protocol violation have their own subclasses. Bad arguments raise the built-in
``ValueError``/``TypeError`` before any work is queued (``ProtocolError`` is both).
"""
from __future__ import annotations


class LowgradError(RuntimeError):
    """Root of every exception lowgrad defines: ``except lowgrad.LowgradError`` catches them all."""


class CudaUnavailableError(LowgradError):
    """No NVIDIA driver or no GPU: raised at first use of the CUDA backend, never at import."""


class CudaError(LowgradError):
    """A CUDA driver call failed. ``call``, ``code``, ``name`` and ``message`` are attributes."""

    def __init__(self, call: str, code: int, name: str, message: str) -> None:
        self.call, self.code, self.name, self.message = call, code, name, message
        super().__init__(f"{call} failed: {name} ({code}): {message}")


class NvrtcError(LowgradError):
    """NVRTC failed; for a compile error ``log`` holds NVRTC's program log."""

    def __init__(self, call: str, name: str, message: str, log: str = "") -> None:
        self.call, self.name, self.message, self.log = call, name, message, log
        text = f"{call} failed: {name}: {message}"
        super().__init__(text + (f"\n--- NVRTC log ---\n{log}" if log else ""))


class NcclError(LowgradError):
    """An NCCL call failed; carries ``ncclGetErrorString`` and ``ncclGetLastError`` text."""

    def __init__(self, call: str, code: int, name: str, message: str, last_error: str = "") -> None:
        self.call, self.code, self.name, self.message, self.last_error = call, code, name, message, last_error
        text = f"{call} failed: {name} ({code}): {message}"
        super().__init__(text + (f" (last error: {last_error})" if last_error else ""))


class NcclLibraryError(LowgradError):
    """libnccl could not be found or loaded, or lacks a symbol lowgrad calls (too old, or not
    NCCL); the message names the library path and the missing symbols."""


class CommTimeoutError(LowgradError):
    """A communicator wait or initialisation exceeded its timeout; the communicator was aborted."""


class CommAbortedError(LowgradError):
    """The communicator was aborted (by another rank's failure, a timeout or ``abort()``)."""


class ClosedError(LowgradError):
    """A tensor, allocation, stream or communicator was used after ``close()``."""


class CaptureError(LowgradError):
    """An operation that is not allowed during CUDA-graph capture (a host sync, an allocation)."""


class NonFiniteGradientError(LowgradError, FloatingPointError):
    """A step's global gradient norm is not finite (a loss spike, or a step discarded after a
    fault on some rank) and the caller asked to raise rather than skip it; nothing was updated."""


class ProtocolError(LowgradError, ValueError):
    """A gradient-manager protocol violation: a fetch out of order, a notify without a fetch,
    reading shards or the norm before a step completed, a micro-step out of sequence. Also a
    ``ValueError``: the call's arguments do not fit the manager's state."""


class CheckpointError(LowgradError, ValueError):
    """A checkpoint that cannot be saved or loaded: missing, half-written, truncated, corrupted (a
    checksum differs), foreign (another model, strategy or optimizer), not this rank's, or a
    failure of any kind on any rank (raised on every rank, naming it). The message names the file
    and what is wrong; nothing in the running state changed."""
