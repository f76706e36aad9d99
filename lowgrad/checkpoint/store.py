"""The on-disk checkpoint of every rank's state, loadable at any world size.

A checkpoint is a directory::

    step-000100/
        manifest.json       written last, by rank 0: what every file holds, with checksums
        rank-00000.bin      rank 0's chunks, raw little-endian C-order bytes, back to back
        rank-00001.bin      ...

``save`` (a collective: every rank calls it) writes into ``.step-000100.partial`` beside the
target, each rank its own file, fsynced; rank 0 then writes the manifest, fsyncs and renames the
directory to its name: before the rename there is no checkpoint, after it a whole one, so a crash
at any point leaves the previous checkpoints as they were (the next save into the same name
removes the leftover). ``load`` (a collective too) reads the chunks that overlap this rank's rows
of each array, whichever world saved them, checks every byte it uses against the manifest's CRC-32
and every rank's verdict before it returns: a checkpoint refused on one rank is refused on all,
and nothing has changed.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, cast

import ml_dtypes  # noqa: F401 - registers numpy's "bfloat16" dtype name, which manifests use
import numpy as np

from lowgrad.base.errors import CheckpointError
from lowgrad.checkpoint import durable
from lowgrad.checkpoint.rows import Rows
from lowgrad.managers.state import ManagerState, resume_state

FORMAT, VERSION = "lowgrad-checkpoint", 1
MANIFEST = "manifest.json"
T = TypeVar("T")


class Loaded(NamedTuple):
    """What :func:`read` found for this rank: its rows of every array, the saved manager state
    (placed at this rank and world) and the ``meta`` the save was given."""

    arrays: dict[str, np.ndarray]
    manager: ManagerState
    meta: dict[str, Any]
    world: int


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def _fingerprint(manager: Any) -> dict[str, Any]:
    """What makes two runs' checkpoints interchangeable: the layout and the gradient dtype."""
    layout = manager.layout
    return {"num_layers": layout.num_layers, "dtype": manager.dtype.name,
            "block": [[s.name, list(s.shape)] for s in layout.block],
            "non_block": [[s.name, list(s.shape)] for s in layout.non_block]}


def agree(comm: Any, fn: Callable[[], T], what: str) -> T:
    """``fn()`` on this rank, then every rank's verdict (a collective over ``comm``): ``fn``'s
    result where every rank succeeded, else CheckpointError on every rank naming each rank that
    failed and why, so that no rank goes on to a collective the others never reach."""
    result, error = _attempt(fn)
    verdicts = comm.host_allgather((error or "").encode())
    bad = [(r, v.decode()) for r, v in enumerate(verdicts) if v]
    if bad:
        raise CheckpointError(f"{what}: " + "; ".join(f"rank {r}: {msg}" for r, msg in bad))
    return cast(T, result)  # no rank failed, this one included


def _attempt(fn: Callable[[], T]) -> tuple[T | None, str | None]:
    """``fn()`` and None, or None and the one-line reason it failed (checked errors and I/O)."""
    try:
        return fn(), None
    except (CheckpointError, OSError, ValueError, TypeError) as e:
        return None, f"{type(e).__name__}: {e}"


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
    the path. CheckpointError on every rank when any rank fails, and no checkpoint appears."""
    arrays = _check_arrays(arrays, "save")
    meta_text = json.dumps(dict(meta or {}))  # TypeError here for data JSON cannot hold
    final = Path(path)
    state = ManagerState.parse(manager.state_dict()).portable()  # ProtocolError inside a step
    comm, rank, world = manager.comm, manager.rank, manager.world
    tmp = final.parent / f".{final.name}.partial"

    def prepare() -> None:
        if final.exists():
            raise CheckpointError(f"{final} exists already (save each checkpoint under a new name)")
        if rank == 0:
            if tmp.exists():  # a save that crashed: never published, never read
                shutil.rmtree(tmp)
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
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
        durable.write_file(tmp / _rank_file(rank), chunks)
        return {"file": _rank_file(rank), "bytes": offset, "chunks": index}
    written, error = _attempt(write)
    verdicts = comm.host_allgather((error or "").encode() if error else json.dumps(written).encode())
    failed = [f"rank {r}: {v.decode()}" for r, v in enumerate(verdicts) if not v.startswith(b"{")]
    if failed:
        raise CheckpointError(f"save {final}: " + "; ".join(failed))

    def commit() -> None:
        per_rank = [json.loads(v) for v in verdicts]
        manifest = {"format": FORMAT, "version": VERSION, "world": world, "manager": state,
                    "layout": _fingerprint(manager), "meta": json.loads(meta_text),
                    "files": {w["file"]: w["bytes"] for w in per_rank}, "arrays": _merge(per_rank, set(arrays))}
        durable.write_file(tmp / MANIFEST, [json.dumps(manifest, indent=1).encode()])
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
        rows = entry["shape"][0] if entry["shape"] else 1
        entry["chunks"].sort(key=lambda c: c["start"])
        covered = 0
        for c in entry["chunks"]:
            if c["start"] != covered:
                raise ValueError(f"array {name!r}: rows [{min(covered, c['start'])}, {max(covered, c['start'])}) "
                                 "are held by no rank or by two")
            covered += c["rows"]
        if covered != rows:
            raise ValueError(f"array {name!r}: the ranks hold {covered} of its {rows} rows")
    return out


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checked manifest of the checkpoint at ``path``: CheckpointError naming the file when
    it is missing (not a checkpoint, or a save that never finished), unreadable or not this
    format."""
    where = Path(path) / MANIFEST
    if not where.is_file():
        raise CheckpointError(f"{where} is missing: {path} is not a checkpoint, or its save did not finish")
    try:
        m = json.loads(where.read_bytes())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{where}: unreadable or not JSON (truncated or corrupted): {e}") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a lowgrad checkpoint manifest")
    if m.get("version") != VERSION:
        raise CheckpointError(f"{where}: version {m.get('version')!r} is not supported (this lowgrad reads "
                              f"version {VERSION})")
    try:
        world = m["world"]
        ok = (isinstance(world, int) and world >= 1 and isinstance(m["manager"], dict)
              and isinstance(m["meta"], dict) and isinstance(m["files"], dict) and isinstance(m["arrays"], dict))
    except KeyError as e:
        raise CheckpointError(f"{where}: malformed: no {e}") from None
    if not ok:
        raise CheckpointError(f"{where}: malformed (a field of the wrong type)")
    return m


def read(path: str | os.PathLike[str], manager: Any, arrays: Mapping[str, Rows]) -> Loaded:
    """This rank's part of the checkpoint at ``path``, checked against ``manager`` and ``arrays``
    (templates: this rank's :class:`Rows` of each array, as :func:`save` was given them; their data
    gives only dtype and row count). Nothing changes: the caller applies what it got. A collective
    over ``manager.comm``; CheckpointError on every rank when any rank refuses the checkpoint."""
    arrays = _check_arrays(arrays, "read")
    return agree(manager.comm, lambda: _read(Path(path), manager, arrays), f"load {path}")


def load(path: str | os.PathLike[str], manager: Any, arrays: Mapping[str, Rows]) -> Loaded:
    """:func:`read`, then the manager's state restored (placed at its rank and world): what an
    engine without PyTorch calls, before applying ``Loaded.arrays`` to its own state."""
    found = read(path, manager, arrays)
    manager.load_state_dict(found.manager.as_dict())
    return found


def _read(path: Path, manager: Any, wanted: dict[str, Rows]) -> Loaded:
    m = read_manifest(path)
    where = path / MANIFEST
    try:
        saved = resume_state(m["manager"], manager)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: manager: {e} (another run's checkpoint?)") from None
    if m.get("layout") != _fingerprint(manager):
        raise CheckpointError(f"{where}: another model: its layout differs from this manager's")
    names = set(m["arrays"])
    if names != set(wanted):
        raise CheckpointError(f"{where}: another model or optimizer: arrays missing "
                              f"{sorted(set(wanted) - names)[:4]}, not expected {sorted(names - set(wanted))[:4]}")
    sizes: dict[str, int] = {}
    out = {}
    for name in sorted(wanted):
        out[name] = _rows(path, m, name, wanted[name], sizes)
    return Loaded(out, saved, m["meta"], m["world"])


def _rows(path: Path, m: dict[str, Any], name: str, want: Rows, sizes: dict[str, int]) -> np.ndarray:
    """Rows ``[want.start, want.stop)`` of array ``name`` from the chunks that hold them, each
    checked (file size, CRC-32) before use."""
    entry = m["arrays"][name]
    try:
        dtype, shape, chunks = np.dtype(entry["dtype"]), tuple(entry["shape"]), entry["chunks"]
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{path / MANIFEST}: array {name!r} malformed ({e})") from None
    if dtype != want.data.dtype or shape != want.shape:
        raise CheckpointError(f"{path / MANIFEST}: array {name!r} is {dtype.name} {list(shape)}, this run's is "
                              f"{want.data.dtype.name} {list(want.shape)} (another model or optimizer?)")
    row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    out = np.empty(want.data.shape, dtype)
    flat = out.reshape(-1).view(np.uint8)
    covered = 0
    for c in chunks:
        lo, hi = max(c["start"], want.start), min(c["start"] + c["rows"], want.stop)
        if not shape:
            lo, hi = 0, 1
        if lo >= hi:
            continue
        file = path / c["file"]
        size = sizes.get(c["file"])
        if size is None:
            try:
                size = sizes[c["file"]] = os.stat(file).st_size
            except OSError as e:
                raise CheckpointError(f"{file}: missing or unreadable ({e.strerror})") from None
            if size != m["files"].get(c["file"]):
                raise CheckpointError(f"{file}: {size} bytes, the manifest says {m['files'].get(c['file'])} "
                                      "(truncated or replaced)")
        with open(file, "rb") as fh:
            fh.seek(c["offset"])
            raw = fh.read(c["bytes"])
        if len(raw) != c["bytes"] or zlib.crc32(raw) != c["crc32"]:
            raise CheckpointError(f"{file}: the chunk of {name!r} (rows [{c['start']}, {c['start'] + c['rows']}), "
                                  f"bytes {c['offset']}..{c['offset'] + c['bytes']}) fails its CRC-32 (corrupted)")
        if shape:
            flat[(lo - want.start) * row:(hi - want.start) * row] = \
                np.frombuffer(raw, np.uint8)[(lo - c["start"]) * row:(hi - c["start"]) * row]
        else:
            flat[:] = np.frombuffer(raw, np.uint8)
        covered += hi - lo
    if covered != (want.stop - want.start):
        raise CheckpointError(f"{path / MANIFEST}: array {name!r}: rows [{want.start}, {want.stop}) are not all "
                              "held by its chunks (malformed)")
    return out


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint under ``root`` with the highest manager step (ties: the last name),
    or None: directories whose manifest is missing or unreadable (a save cut short, another
    file) are passed over, so after a crash the previous checkpoint is the one resumed."""
    best: tuple[int, str] | None = None
    found = None
    for d in sorted(Path(root).iterdir()) if Path(root).is_dir() else []:
        if d.name.startswith(".") or not d.is_dir():
            continue
        try:
            step = read_manifest(d)["manager"]["step"]
        except (CheckpointError, KeyError, TypeError):
            continue
        if isinstance(step, int) and (best is None or (step, d.name) >= best):
            best, found = (step, d.name), d
    return found
