"""NCCL through ctypes: library discovery, typed prototypes and error mapping.

The library is loaded at first use (never at import) from, in order: ``LOWGRAD_NCCL_LIBRARY``
(a path), the ``nvidia-nccl-cu12`` / ``nvidia-nccl-cu13`` wheels (the one matching the installed
``cuda-bindings`` major version first), then ``libnccl.so.2`` on the system loader path.

The collective wrappers are thin: they take ints (device pointers, element counts, the
``ncclDataType_t`` code of ``DType.nccl`` and the ``ncclRedOp_t`` code of
:data:`lowgrad.contracts.communicator.OPS`, the communicator handle and a ``cudaStream_t`` handle), call
NCCL once and return the ``ncclResult_t`` when it is ``ncclSuccess`` (0) or ``ncclInProgress``
(7, non-blocking communicators); any other code raises
:class:`~lowgrad.base.errors.NcclError` with ``ncclGetErrorString`` and ``ncclGetLastError``.
Every call is asynchronous with respect to the host: it queues work on the given stream.
They use the loaded library directly: call :func:`lib` first (every Communicator has).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import threading
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_void_p
from importlib import metadata

from lowgrad.base import trace
from lowgrad.base.errors import NcclError
from lowgrad.base.errors import NcclLibraryError as NcclLibraryError  # re-exported: callers catch nccl.NcclLibraryError

SUCCESS, IN_PROGRESS = 0, 7
RESULT_NAMES = ("ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
                "ncclInvalidArgument", "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress",
                "ncclTimeout")
UNIQUE_ID_BYTES = 128
_UNDEF_INT = -2147483648  # NCCL_CONFIG_UNDEF_INT (INT_MIN)
_API_MAGIC = 0xCAFEBEEF
_CONFIG_VERSION = 21800  # NCCL_VERSION(2, 18, 0): the layout _Config mirrors
# the oldest NCCL lowgrad loads: ncclCommSplit (the blocking mode's communicator, split()) and the
# ncclConfig_t layout above are 2.18's; an older library is refused with this in the message
MIN_VERSION = "2.18"


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_ubyte * UNIQUE_ID_BYTES)]


class _Config(ctypes.Structure):
    """``ncclConfig_t`` up to ``splitShare`` (the NCCL 2.18 layout). NCCL copies ``size`` bytes
    and keeps its defaults for every later field, so newer libraries read only these."""

    _fields_ = [("size", c_size_t), ("magic", c_uint), ("version", c_uint), ("blocking", c_int),
                ("cgaClusterSize", c_int), ("minCTAs", c_int), ("maxCTAs", c_int),
                ("netName", c_char_p), ("splitShare", c_int)]


_CONFIG_SIZE = _Config.splitShare.offset + ctypes.sizeof(c_int)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_path = ""

_PROTOTYPES = {
    "ncclGetVersion": (POINTER(c_int),),
    "ncclGetUniqueId": (POINTER(_UniqueId),),
    "ncclGetErrorString": None,  # special: returns const char*
    "ncclGetLastError": None,
    "ncclCommInitRankConfig": (POINTER(c_void_p), c_int, _UniqueId, c_int, POINTER(_Config)),
    # comm, color, key, newcomm, config (NCCL >= 2.18)
    "ncclCommSplit": (c_void_p, c_int, c_int, POINTER(c_void_p), POINTER(_Config)),
    "ncclCommGetAsyncError": (c_void_p, POINTER(c_int)),
    "ncclCommCount": (c_void_p, POINTER(c_int)),
    "ncclCommUserRank": (c_void_p, POINTER(c_int)),
    "ncclCommAbort": (c_void_p,),
    "ncclCommFinalize": (c_void_p,),
    "ncclCommDestroy": (c_void_p,),
    "ncclGroupStart": (),
    "ncclGroupEnd": (),
    # sendbuff, recvbuff, recvcount, datatype, op, comm, stream
    "ncclReduceScatter": (c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p),
    # sendbuff, recvbuff, sendcount, datatype, comm, stream
    "ncclAllGather": (c_void_p, c_void_p, c_size_t, c_int, c_void_p, c_void_p),
    # sendbuff, recvbuff, count, datatype, op, comm, stream
    "ncclAllReduce": (c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p),
    # buff, count, datatype, peer, comm, stream
    "ncclSend": (c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p),
    "ncclRecv": (c_void_p, c_size_t, c_int, c_int, c_void_p, c_void_p),
}


def _wheel_candidates() -> list[str]:
    """libnccl.so* shipped by the nvidia-nccl-cu13/-cu12 wheels, best match first."""
    dists = ["nvidia-nccl-cu12", "nvidia-nccl-cu13"]
    try:
        from cuda import bindings
        if str(getattr(bindings, "__version__", "")).startswith("13"):
            dists.reverse()
    except ImportError:
        pass
    found: list[str] = []
    for dist in dists:
        try:
            files = metadata.files(dist) or []
        except metadata.PackageNotFoundError:
            continue
        for f in files:
            if os.path.basename(str(f)).startswith("libnccl.so"):
                found.append(str(f.locate()))
    try:
        import nvidia  # namespace package of the NVIDIA wheels
        roots = list(nvidia.__path__)
    except ImportError:
        roots = []
    for root in roots:
        for pattern in ("nccl/lib/libnccl.so*", "cu13/lib/libnccl.so*", "cu12/lib/libnccl.so*",
                        "*/lib/libnccl.so*"):
            found.extend(sorted(glob.glob(os.path.join(root, pattern))))
    seen: dict[str, None] = {}
    for p in found:
        if os.path.isfile(p) and ".so" in p:
            seen.setdefault(os.path.realpath(p), None)
    return list(seen)


def _open(path: str) -> ctypes.CDLL:
    """Load ``path`` and give every symbol of :data:`_PROTOTYPES` its prototype; OSError when it
    cannot be loaded, NcclLibraryError naming the path and every missing symbol."""
    lib = ctypes.CDLL(path)
    if not hasattr(lib, "ncclGetVersion"):
        raise NcclLibraryError(f"{path} lacks the symbol ncclGetVersion: not an NCCL library")
    missing = [name for name in _PROTOTYPES if not hasattr(lib, name)]
    if missing:
        raise NcclLibraryError(f"{path} lacks the symbol(s) {', '.join(missing)} that lowgrad calls "
                               f"(an older or partial NCCL: lowgrad needs NCCL {MIN_VERSION} or newer)")
    for name, args in _PROTOTYPES.items():
        fn = getattr(lib, name)
        if args is None:
            fn.restype = c_char_p
            fn.argtypes = (c_int,) if name == "ncclGetErrorString" else (c_void_p,)
        else:
            fn.restype, fn.argtypes = c_int, args
    return lib


#: the environment variable naming the libnccl to load (read here only: every layer asks this module)
LIBRARY_ENV = "LOWGRAD_NCCL_LIBRARY"
_SYSTEM_NAME = "libnccl.so.2"  # the last resort: the system loader's search path


def library_candidates() -> list[str]:
    """Where NCCL is looked for, in the order :func:`lib` tries them (nothing is loaded): the
    path in ``LOWGRAD_NCCL_LIBRARY`` alone when it is set, else the ``libnccl.so*`` of the
    NVIDIA wheels (:func:`_wheel_candidates`, the best match first), what
    ``ctypes.util.find_library("nccl")`` knows, and ``libnccl.so.2`` on the loader's path."""
    env = os.environ.get(LIBRARY_ENV)
    if env:
        return [env]
    found = [*_wheel_candidates(), ctypes.util.find_library("nccl") or "", _SYSTEM_NAME]
    return list(dict.fromkeys(p for p in found if p))


def library_absent() -> bool:
    """Whether there is no NCCL anywhere :func:`library_candidates` looks: no
    ``LOWGRAD_NCCL_LIBRARY``, no libnccl in an NVIDIA wheel, none that ``find_library`` knows, and
    the loader has no file named ``libnccl.so.2`` (its error names that file, not a dependency).
    False where a library is there but does not load: that is a broken install, not an absent one
    (the doctor tells the two apart by this)."""
    if library_candidates() != [_SYSTEM_NAME]:
        return False
    try:
        ctypes.CDLL(_SYSTEM_NAME)
    except OSError as exc:
        return str(exc).startswith(f"{_SYSTEM_NAME}: cannot open shared object file")
    return False


def _load() -> ctypes.CDLL:
    global _lib, _path
    with _lock:
        if _lib is not None:
            return _lib
        env = os.environ.get(LIBRARY_ENV)
        tried: dict[str, str] = {}  # path -> why it was not used
        found: ctypes.CDLL | None = None
        for path in library_candidates():
            try:
                found = _open(path)
                break
            except (OSError, NcclLibraryError) as exc:
                tried[path] = str(exc)
        if found is None:
            if env:
                raise NcclLibraryError(f"{LIBRARY_ENV}={env!r} cannot be loaded as NCCL: {tried[env]}")
            raise NcclLibraryError(
                "NCCL not found: install nvidia-nccl-cu12 or nvidia-nccl-cu13, or set "
                f"{LIBRARY_ENV} to libnccl.so.2 (tried: {'; '.join(tried.values())})")
        _path = getattr(found, "_name", path) or path
        _lib = found
        return found


def lib() -> ctypes.CDLL:
    """The loaded NCCL library (loads it at first call)."""
    return _lib if _lib is not None else _load()


def library_path() -> str:
    """The path of the loaded libnccl."""
    lib()
    return _path


def error(call: str, code: int, comm: int | None = None) -> NcclError:
    """The exception for NCCL call ``call`` that returned ``code`` (``comm``: its handle, for
    ``ncclGetLastError``)."""
    L = lib()
    name = RESULT_NAMES[code] if 0 <= code < len(RESULT_NAMES) else f"ncclResult_t {code}"
    msg = (L.ncclGetErrorString(code) or b"unknown error").decode(errors="replace")
    last = (L.ncclGetLastError(comm or None) or b"").decode(errors="replace")
    return NcclError(call, code, name, msg, last)


def check(call: str, rc: int, comm: int | None = None) -> int:
    """Return ``rc`` when it is ncclSuccess or ncclInProgress, else raise :func:`error`."""
    if rc and rc != IN_PROGRESS:
        raise error(call, rc, comm)
    return rc


def version() -> tuple[int, int, int]:
    """(major, minor, patch) of the loaded NCCL."""
    v = c_int()
    check("ncclGetVersion", lib().ncclGetVersion(byref(v)))
    code = v.value
    if code >= 10000:  # NCCL >= 2.9: major*10000 + minor*100 + patch
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def unique_id() -> bytes:
    """A new 128-byte ``ncclUniqueId`` (rank 0 creates it; every rank passes the same bytes)."""
    uid = _UniqueId()
    check("ncclGetUniqueId", lib().ncclGetUniqueId(byref(uid)))
    return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)


# ---- communicator lifetime ----------------------------------------------------------------
def comm_init_rank(world: int, uid: bytes, rank: int, blocking: bool = False) -> tuple[int, int]:
    """``ncclCommInitRankConfig`` with ``blocking`` (default non-blocking). Returns
    ``(handle, rc)``; with rc == IN_PROGRESS poll :func:`comm_get_async_error`. The calling
    thread's current CUDA context selects the device."""
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"unique id must be {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
    cfg = _config(blocking)
    ident = _UniqueId.from_buffer_copy(uid)
    handle = c_void_p()
    rc = lib().ncclCommInitRankConfig(byref(handle), world, ident, rank, byref(cfg))
    check("ncclCommInitRankConfig", rc, handle.value)
    return handle.value or 0, rc


def comm_split(comm: int, color: int, key: int, blocking: bool) -> tuple[c_void_p, int]:
    """``ncclCommSplit``: collective over every rank of ``comm``; ranks of equal ``color`` (>= 0)
    form a new communicator ranked by ``key`` (ties: the parent's rank), with its own resources
    (``splitShare`` 0) and ``blocking`` mode. Returns ``(newcomm, rc)``: ``newcomm`` is the
    ``ncclComm_t`` cell NCCL writes the child into. A blocking split blocks the host until every
    rank has called it and returns with the cell filled; ``ncclCommAbort`` of the parent ends it.
    On a non-blocking parent the split runs on NCCL's own thread, whatever rc says (NCCL 2.28
    returns ncclSuccess there: the group's ncclInProgress is not passed on): the cell stays NULL
    until :func:`comm_get_async_error` of the *parent* reports ncclSuccess (NCCL writes it
    then), and the parent refuses every other call until that moment. So the caller polls the
    parent, and keeps the cell alive until then, and longer when it gives up: NCCL may still
    write it."""
    cfg = _config(blocking)
    cfg.splitShare = 0
    newcomm = c_void_p()
    rc = lib().ncclCommSplit(comm, color, key, byref(newcomm), byref(cfg))
    check("ncclCommSplit", rc, comm)
    return newcomm, rc


def _config(blocking: bool) -> _Config:
    """An ``ncclConfig_t`` with NCCL's defaults but ``blocking``."""
    return _Config(size=_CONFIG_SIZE, magic=_API_MAGIC, version=_CONFIG_VERSION, blocking=int(blocking),
                   cgaClusterSize=_UNDEF_INT, minCTAs=_UNDEF_INT, maxCTAs=_UNDEF_INT, netName=None,
                   splitShare=_UNDEF_INT)


def comm_get_async_error(comm: int) -> int:
    """The communicator's asynchronous state: 0 done/healthy, IN_PROGRESS, or an error code."""
    state = c_int()
    check("ncclCommGetAsyncError", lib().ncclCommGetAsyncError(comm, byref(state)), comm)
    return state.value


def comm_rank_world(comm: int) -> tuple[int, int]:
    """(rank, world) of an initialised communicator (``ncclCommUserRank``, ``ncclCommCount``)."""
    rank, world = c_int(), c_int()
    check("ncclCommUserRank", lib().ncclCommUserRank(comm, byref(rank)), comm)
    check("ncclCommCount", lib().ncclCommCount(comm, byref(world)), comm)
    return rank.value, world.value


def comm_abort(comm: int) -> None:
    """``ncclCommAbort``: stop outstanding work and free the communicator (never blocks on peers)."""
    check("ncclCommAbort", lib().ncclCommAbort(comm))


def comm_finalize(comm: int) -> int:
    """``ncclCommFinalize``: flush outstanding work (may return IN_PROGRESS when non-blocking)."""
    return check("ncclCommFinalize", lib().ncclCommFinalize(comm), comm)


def comm_destroy(comm: int) -> None:
    """``ncclCommDestroy``: free a finalized communicator."""
    check("ncclCommDestroy", lib().ncclCommDestroy(comm))


def group_start() -> None:
    """``ncclGroupStart`` (per calling thread)."""
    check("ncclGroupStart", lib().ncclGroupStart())


def group_end() -> int:
    """``ncclGroupEnd``: launch what the group scheduled; IN_PROGRESS on non-blocking comms."""
    return check("ncclGroupEnd", lib().ncclGroupEnd())


# ---- collectives and point-to-point (hot path: ints in, one ctypes call) -------------------
def reduce_scatter(send: int, recv: int, count: int, dtype: int, op: int, comm: int, stream: int) -> int:
    """Reduce ``world * count`` elements at ``send``; rank r's ``count`` results land at ``recv``."""
    rc = _lib.ncclReduceScatter(send, recv, count, dtype, op, comm, stream)  # type: ignore[union-attr]
    if trace.ENABLED:
        trace.log("nccl", "ncclReduceScatter", count=count, dtype=dtype, op=op, stream=hex(stream))
    return check("ncclReduceScatter", rc, comm) if rc else 0


def all_gather(send: int, recv: int, count: int, dtype: int, comm: int, stream: int) -> int:
    """Gather ``count`` elements from every rank into ``world * count`` at ``recv`` (rank order)."""
    rc = _lib.ncclAllGather(send, recv, count, dtype, comm, stream)  # type: ignore[union-attr]
    if trace.ENABLED:
        trace.log("nccl", "ncclAllGather", count=count, dtype=dtype, stream=hex(stream))
    return check("ncclAllGather", rc, comm) if rc else 0


def all_reduce(send: int, recv: int, count: int, dtype: int, op: int, comm: int, stream: int) -> int:
    """Reduce ``count`` elements across ranks; every rank receives the result at ``recv``."""
    rc = _lib.ncclAllReduce(send, recv, count, dtype, op, comm, stream)  # type: ignore[union-attr]
    if trace.ENABLED:
        trace.log("nccl", "ncclAllReduce", count=count, dtype=dtype, op=op, stream=hex(stream))
    return check("ncclAllReduce", rc, comm) if rc else 0


def send(buf: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> int:
    """Send ``count`` elements at ``buf`` to rank ``peer``."""
    rc = _lib.ncclSend(buf, count, dtype, peer, comm, stream)  # type: ignore[union-attr]
    if trace.ENABLED:
        trace.log("nccl", "ncclSend", count=count, dtype=dtype, peer=peer, stream=hex(stream))
    return check("ncclSend", rc, comm) if rc else 0


def recv(buf: int, count: int, dtype: int, peer: int, comm: int, stream: int) -> int:
    """Receive ``count`` elements from rank ``peer`` into ``buf``."""
    rc = _lib.ncclRecv(buf, count, dtype, peer, comm, stream)  # type: ignore[union-attr]
    if trace.ENABLED:
        trace.log("nccl", "ncclRecv", count=count, dtype=dtype, peer=peer, stream=hex(stream))
    return check("ncclRecv", rc, comm) if rc else 0
