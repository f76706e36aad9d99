"""The on-disk checkpoint of every rank's state, loadable at any world size.

A checkpoint is a directory::

    step-000100/
        manifest.json       written last, by rank 0: what every file holds, with checksums
        rank-00000.bin      rank 0's chunks, raw little-endian C-order bytes, back to back
        rank-00001.bin      ...

``save`` (a collective: every rank calls it) writes into ``.step-000100.TOKEN.partial`` beside the
target (TOKEN: rank 0's random one, so two saves never share it), each rank its own file, fsynced;
rank 0 then writes the manifest, fsyncs and renames the directory to its name: before the rename
there is no checkpoint, after it a whole one, so a crash at any point leaves the previous
checkpoints as they were (the next save in the same directory removes the leftover). ``load`` (a
collective too) reads the chunks that overlap this rank's rows of each array, whichever world saved
them, checks the manifest (its own CRC-32, its whole schema) and every byte it uses against the
manifest's CRC-32, and every rank's verdict, the identity of the manifest each read included, before
it returns: a checkpoint refused on one rank is refused on all, and nothing has changed.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, cast

import numpy as np

from lowgrad.base.errors import CheckpointError
from lowgrad.base.trace import logger
from lowgrad.checkpoint import durable, files, manifest
from lowgrad.checkpoint.manifest import rank_file
from lowgrad.checkpoint.rows import Rows
from lowgrad.managers.state import ManagerState, resume_state

T = TypeVar("T")


class Loaded(NamedTuple):
    """What :func:`read` found for this rank: its rows of every array, the saved manager state
    (placed at this rank and world) and the ``meta`` the save was given."""

    arrays: dict[str, np.ndarray]
    manager: ManagerState
    meta: dict[str, Any]
    world: int


def _fingerprint(manager: Any) -> dict[str, Any]:
    """What makes two runs' checkpoints interchangeable: the layout and the gradient dtype."""
    layout = manager.layout
    return {"num_layers": layout.num_layers, "dtype": manager.dtype.name,
            "block": [[s.name, list(s.shape)] for s in layout.block],
            "non_block": [[s.name, list(s.shape)] for s in layout.non_block]}


def agree(comm: Any, fn: Callable[[], T], what: str, key: Callable[[T], str] | None = None) -> T:
    """``fn()`` on this rank, then every rank's verdict (a collective over ``comm``): ``fn``'s
    result where every rank succeeded, else CheckpointError on every rank naming each rank that
    failed and why (whatever ``fn`` raised: chained on the rank that raised it), so that no rank
    goes on to a collective the others never reach. ``key`` gives what every rank's result must
    share (which checkpoint each read): CheckpointError on every rank when the ranks' differ."""
    result, error = _attempt(fn)
    mine = f"!{_reason(error)}" if error is not None else "=" + (key(cast(T, result)) if key else "")
    verdicts = [v.decode() for v in comm.host_allgather(mine.encode())]
    bad = [f"rank {r}: {v[1:]}" for r, v in enumerate(verdicts) if v.startswith("!")]
    if bad:
        raise CheckpointError(f"{what}: " + "; ".join(bad)) from error
    if len(set(verdicts)) > 1:
        raise CheckpointError(f"{what}: the ranks read different checkpoints (each rank's latest() differs?): "
                              + "; ".join(f"rank {r}: {v[1:]}" for r, v in enumerate(verdicts)))
    return cast(T, result)  # no rank failed, this one included


def _attempt(fn: Callable[[], T]) -> tuple[T | None, Exception | None]:
    """``fn()`` and None, or None and what it raised: any error, so that this rank still gives its
    verdict (a bug or a malformed input here must not strand the other ranks in the collective)."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised chained by agree
        return None, e


def _reason(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def _check_arrays(arrays: Any, what: str) -> dict[str, Rows]:
    if not isinstance(arrays, Mapping) or not all(isinstance(k, str) and isinstance(v, Rows)
                                                  for k, v in arrays.items()):
        raise TypeError(f"{what}: arrays must map str names to lowgrad.checkpoint.Rows")
    return dict(arrays)


def save(path: str | os.PathLike[str], manager: Any, arrays: Mapping[str, Rows],
         meta: Mapping[str, Any] | None = None) -> Path:
    """Write a checkpoint of ``manager`` (its portable state: strategy, rounding, base seed and
    step) and ``arrays`` (this rank's :class:`Rows` of each named array; every rank the same
    names) at ``path``, a directory that must not exist yet; ``meta`` is JSON data every rank
    gives alike (rank 0's is kept). A collective over ``manager.comm``, between steps. Returns
    the path. CheckpointError on every rank when any rank fails (its arguments included: a
    ``meta`` JSON cannot hold, a save inside a step), and no checkpoint appears."""
    def check() -> tuple[Path, dict[str, Rows], str, dict[str, Any]]:
        return (Path(path), _check_arrays(arrays, "save"),
                json.dumps(dict(meta or {})),  # TypeError here for data JSON cannot hold
                ManagerState.parse(manager.state_dict()).portable())  # ProtocolError inside a step
    final, arrays, meta_text, state = agree(manager.comm, check, f"save {path}")
    token = manager.comm.host_allgather(secrets.token_hex(8).encode() if manager.rank == 0 else b"")[0].decode()
    tmp = durable.partial(final, token)  # this save's own: another save never writes into it
    lock: list[int] = []
    try:
        return _save(final, tmp, lock, manager, arrays, meta_text, state)
    finally:
        for fd in lock:
            durable.release(fd)


def _save(final: Path, tmp: Path, lock: list[int], manager: Any, arrays: dict[str, Rows], meta_text: str,
          state: dict[str, Any]) -> Path:
    comm, rank, world = manager.comm, manager.rank, manager.world

    def prepare() -> None:
        if final.exists():
            raise CheckpointError(f"{final} exists already (save each checkpoint under a new name)")
        if rank == 0:
            durable.make_dirs(final.parent)
            durable.remove_stale(final.parent)  # leftovers of saves that crashed or failed: never read
            lock.append(durable.claim(tmp))  # held until the save returns: no other save removes it
    agree(comm, prepare, f"save {final}")

    def write() -> dict[str, Any]:
        index: dict[str, Any] = {}
        chunks: list[bytes | memoryview] = []
        offset = 0
        for name in sorted(arrays):
            r = arrays[name]
            if r.whole and rank != 0:
                continue  # the same on every rank: rank 0's copy
            data = np.ascontiguousarray(r.data)
            raw = memoryview(data.view(np.uint8).reshape(-1).data) if data.size else memoryview(b"")
            index[name] = {"dtype": data.dtype.name, "shape": list(r.shape), "start": r.start,
                           "rows": r.stop - r.start, "offset": offset, "bytes": raw.nbytes,
                           "crc32": zlib.crc32(raw)}
            chunks.append(raw)
            offset += raw.nbytes
        durable.write_file(tmp / rank_file(rank), chunks)
        return {"file": rank_file(rank), "bytes": offset, "chunks": index}
    written, error = _attempt(write)
    verdicts = comm.host_allgather(_reason(error).encode() if error else json.dumps(written).encode())
    failed = [f"rank {r}: {v.decode()}" for r, v in enumerate(verdicts) if not v.startswith(b"{")]
    if failed:
        raise CheckpointError(f"save {final}: " + "; ".join(failed)) from error

    def commit() -> None:
        per_rank = [json.loads(v) for v in verdicts]
        m = {"format": manifest.FORMAT, "version": manifest.VERSION, "world": world, "manager": state,
             "layout": _fingerprint(manager), "meta": json.loads(meta_text),
             "files": {w["file"]: w["bytes"] for w in per_rank}, "arrays": _merge(per_rank, set(arrays))}
        durable.write_file(tmp / manifest.NAME, [manifest.encode(m)])
        durable.publish(tmp, final)
    agree(comm, commit if rank == 0 else lambda: None, f"save {final}")
    return final


def _merge(per_rank: list[dict[str, Any]], names: set[str]) -> dict[str, Any]:
    """The manifest's arrays from every rank's index: each array's chunks must agree on dtype and
    shape and cover its rows exactly once (ValueError otherwise: the ranks' states disagree)."""
    out: dict[str, Any] = {}
    for w in per_rank:
        for name, c in w["chunks"].items():
            entry = out.setdefault(name, {"dtype": c["dtype"], "shape": c["shape"], "chunks": []})
            if (entry["dtype"], entry["shape"]) != (c["dtype"], c["shape"]):
                raise ValueError(f"array {name!r}: the ranks disagree on its dtype and shape "
                                 f"({entry['dtype']} {entry['shape']} and {c['dtype']} {c['shape']})")
            entry["chunks"].append({"file": w["file"], **{k: c[k] for k in ("start", "rows", "offset", "bytes",
                                                                             "crc32")}})
    for name in names:
        if name not in out:
            raise ValueError(f"array {name!r}: no rank holds it")
        entry = out[name]
        entry["chunks"].sort(key=lambda c: (c["start"], c["rows"]))
        try:
            manifest.cover(entry["chunks"], entry["shape"][0] if entry["shape"] else 1)
        except ValueError as e:
            raise ValueError(f"array {name!r}: the ranks' rows disagree: {e}") from None
    return out


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checked manifest of the checkpoint at ``path``: CheckpointError naming the file when
    it is missing (not a checkpoint, or a save that never finished), unreadable, not this format,
    fails its own CRC-32 or is malformed in any field."""
    return manifest.read(Path(path))


def read(path: str | os.PathLike[str], manager: Any, arrays: Mapping[str, Rows]) -> Loaded:
    """This rank's part of the checkpoint at ``path``, checked against ``manager`` and ``arrays``
    (templates: this rank's :class:`Rows` of each array, as :func:`save` was given them; their data
    gives only dtype and row count). Nothing changes: the caller applies what it got. A collective
    over ``manager.comm``; CheckpointError on every rank when any rank refuses the checkpoint or
    its arguments."""
    return _read_agreed(path, manager, arrays, restoring=False)


def load(path: str | os.PathLike[str], manager: Any, arrays: Mapping[str, Rows]) -> Loaded:
    """:func:`read`, then the manager's state restored (placed at its rank and world): what an
    engine without PyTorch calls, before applying ``Loaded.arrays`` to its own state. A load
    inside a step is refused with the rest, on every rank, before anything changes."""
    found = _read_agreed(path, manager, arrays, restoring=True)
    manager.load_state_dict(found.manager.as_dict())
    return found


def _read_agreed(path: str | os.PathLike[str], manager: Any, arrays: Mapping[str, Rows], restoring: bool) -> Loaded:
    def attempt() -> tuple[Loaded, str]:
        if restoring:
            manager.state_dict()  # ProtocolError inside a step, where load_state_dict would raise it
        return _read(Path(path), manager, _check_arrays(arrays, "read"))
    found, _ = agree(manager.comm, attempt, f"load {path}", key=lambda got: got[1])
    return found


def _read(path: Path, manager: Any, wanted: dict[str, Rows]) -> tuple[Loaded, str]:
    """What this rank reads, and which checkpoint that is (every rank must have read the same)."""
    m = manifest.read(path)
    where = path / manifest.NAME
    try:
        saved = resume_state(m["manager"], manager)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: manager: {e} (another run's checkpoint?)") from None
    mine = _fingerprint(manager)
    if m["layout"] != mine:
        raise CheckpointError(f"{where}: another model: {_layout_difference(m['layout'], mine)}")
    names = set(m["arrays"])
    if names != set(wanted):
        raise CheckpointError(f"{where}: another model or optimizer: arrays missing "
                              f"{sorted(set(wanted) - names)[:4]}, not expected {sorted(names - set(wanted))[:4]}")
    sizes: dict[str, int] = {}
    out = {}
    for name in sorted(wanted):
        out[name] = _rows(path, m, name, wanted[name], sizes)
    # the manifest's content, not the path: ranks may reach one checkpoint by different paths
    identity = f"the checkpoint whose manifest's CRC-32 is {m['crc32']:08x} (step {saved.step}, world {m['world']})"
    return Loaded(out, saved, m["meta"], m["world"]), identity


def _layout_difference(saved: dict[str, Any], mine: dict[str, Any]) -> str:
    """What first differs between a checkpoint's layout (the manifest's: any JSON object) and this
    manager's (:func:`_fingerprint`): the parameter by name where one differs."""
    for key, what in (("num_layers", "number of layers"), ("dtype", "gradient dtype")):
        if saved.get(key) != mine[key]:
            return f"its {what} is {saved.get(key)!r}, this manager's {mine[key]!r}"
    for key, what in (("block", "block parameter"), ("non_block", "non-block parameter")):
        ours = {name: shape for name, shape in mine[key]}
        theirs = saved.get(key)
        if not isinstance(theirs, list) or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                                   for p in theirs):
            return f"its {what}s are not a list of [name, shape] ({theirs!r:.60})"
        shapes = {name: shape for name, shape in theirs}
        for name in [*ours, *(n for n in shapes if n not in ours)]:
            if name not in shapes:
                return f"this manager's {what} {name!r} is not in it"
            if name not in ours:
                return f"its {what} {name!r} is not this manager's"
            if shapes[name] != ours[name]:
                return f"{what} {name!r} is {shapes[name]} there, {ours[name]} in this manager"
        if theirs != mine[key]:
            return f"its {what}s are in another order: {[p[0] for p in theirs][:6]}"
    return f"its layout holds {sorted(saved)}, this manager's {sorted(mine)}"


def _rows(path: Path, m: dict[str, Any], name: str, want: Rows, sizes: dict[str, int]) -> np.ndarray:
    """Rows ``[want.start, want.stop)`` of array ``name`` from the chunks that hold them (the
    manifest checked: they hold every row once), each checked (file size, CRC-32) before use."""
    entry = m["arrays"][name]
    dtype, shape = np.dtype(entry["dtype"]), tuple(entry["shape"])
    if dtype != want.data.dtype or shape != want.shape:
        raise CheckpointError(f"{path / manifest.NAME}: array {name!r} is {dtype.name} {list(shape)}, this run's is "
                              f"{want.data.dtype.name} {list(want.shape)} (another model or optimizer?)")
    row = math.prod(shape[1:]) * dtype.itemsize
    out = np.empty(want.data.shape, dtype)
    flat = out.reshape(-1).view(np.uint8)
    for c in entry["chunks"]:
        lo, hi = max(c["start"], want.start), min(c["start"] + c["rows"], want.stop)
        if not shape:
            lo, hi = 0, 1
        if lo >= hi:
            continue
        file = path / c["file"]
        if c["file"] not in sizes:
            sizes[c["file"]] = _check_size(path, m, c["file"])
        with open(file, "rb") as fh:
            fh.seek(c["offset"])
            raw = fh.read(c["bytes"])
        if len(raw) != c["bytes"] or zlib.crc32(raw) != c["crc32"]:
            raise _corrupted(file, name, c)
        if shape:
            flat[(lo - want.start) * row:(hi - want.start) * row] = \
                np.frombuffer(raw, np.uint8)[(lo - c["start"]) * row:(hi - c["start"]) * row]
        else:
            flat[:] = np.frombuffer(raw, np.uint8)
    return out


def _corrupted(file: Path, name: str, c: dict[str, Any]) -> CheckpointError:
    return CheckpointError(f"{file}: the chunk of {name!r} (rows [{c['start']}, {c['start'] + c['rows']}), "
                           f"bytes {c['offset']}..{c['offset'] + c['bytes']}) fails its CRC-32 (corrupted)")


def _check_size(path: Path, m: dict[str, Any], name: str) -> int:
    """The size of the checkpoint's file ``name``: CheckpointError naming it when it is missing,
    not a regular file (what it is) or not the size the manifest lists."""
    file = path / name
    size = files.regular(file, "the checkpoint lacks a rank's file").st_size
    if size != m["files"][name]:
        raise CheckpointError(f"{file}: {size} bytes, the manifest says {m['files'][name]} (truncated or replaced)")
    return size


def verify(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` once every byte of it passed its check: the
    manifest's (as :func:`read_manifest`), every listed file's kind and size, and the CRC-32 of
    every chunk, read in pieces of :data:`_PIECE` bytes. CheckpointError naming the first file
    that fails. Not a collective: a pass over the whole checkpoint by the process that calls it."""
    return _verify(Path(path))


def _verify(where: Path) -> dict[str, Any]:
    m = manifest.read(where)
    for name in m["files"]:
        _check_size(where, m, name)
    by_file: dict[str, list[tuple[int, str, dict[str, Any]]]] = {}
    for name, entry in m["arrays"].items():
        for c in entry["chunks"]:
            by_file.setdefault(c["file"], []).append((c["offset"], name, c))
    for file, chunks in sorted(by_file.items()):  # each file opened once, read front to back
        with open(where / file, "rb") as fh:
            for offset, name, c in sorted(chunks, key=lambda x: x[:2]):
                fh.seek(offset)
                crc, left = 0, c["bytes"]
                while left:
                    piece = fh.read(min(left, _PIECE))
                    if not piece:
                        break  # the file shrank since its size was checked: the CRC-32 fails
                    crc, left = zlib.crc32(piece, crc), left - len(piece)
                if left or crc != c["crc32"]:
                    raise _corrupted(where / file, name, c)
    return m


_PIECE = 1 << 24  # verify's reads: a chunk of any size in bounded memory


def latest(root: str | os.PathLike[str], verify: bool = False) -> Path | None:
    """The whole checkpoint under ``root`` with the highest manager step (ties: the last name),
    or None: directories whose manifest is missing or refused (a save cut short, another file, an
    edit, a FIFO) or one of whose files is missing, not a regular file or not its listed size are
    passed over, so after a crash the previous checkpoint is the one resumed. Without ``verify``
    the files' CRC-32s are not read (:func:`load` checks those of the bytes it uses); with it,
    the newest checkpoint every chunk of which passes its CRC-32 (:func:`verify`, newest first:
    a pass over every byte of each one tried). A directory passed over for any reason but a
    missing manifest (not a checkpoint) is a WARNING on the ``lowgrad`` logger naming why."""
    found: list[tuple[int, str, Path]] = []
    for d in sorted(Path(root).iterdir()) if Path(root).is_dir() else []:
        if d.name.startswith(".") or not d.is_dir():
            continue
        try:
            m = manifest.read(d)
            for name in m["files"]:
                _check_size(d, m, name)
        except CheckpointError as e:
            _passed_over(root, d, e)
            continue
        found.append((m["manager"]["step"], d.name, d))
    for _, _, d in sorted(found, reverse=True):
        try:
            if verify:
                _verify(d)
        except CheckpointError as e:
            _passed_over(root, d, e)
            continue
        return d
    return None


def _passed_over(root: str | os.PathLike[str], d: Path, why: CheckpointError) -> None:
    if os.path.lexists(d / manifest.NAME):  # without one it is no checkpoint: nothing to say
        logger.warning("checkpoint.latest(%s): %s passed over: %s", os.fspath(root), d.name, why)
