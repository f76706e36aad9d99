"""``manifest.json``: its encoding with its own CRC-32, and the one check of its whole schema, so
that the reader, :func:`lowgrad.checkpoint.latest` and every rank's load see a manifest either
whole and consistent or refused naming the file."""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401 - registers numpy's "bfloat16" dtype name, which manifests use
import numpy as np

from lowgrad.base.errors import CheckpointError
from lowgrad.checkpoint import files
from lowgrad.managers.state import ManagerState

FORMAT, VERSION = "lowgrad-checkpoint", 2
NAME = "manifest.json"
#: the most bytes a ``manifest.json`` may hold. ``save`` refuses to write a larger one, so a larger
#: file was never a lowgrad manifest and is refused unread (a 4 GiB one would be read whole, and
#: ``latest()`` end in MemoryError). What a manifest legitimately holds grows with its chunks, one
#: per array and rank holding rows of it, about 180 bytes each as ``encode`` writes them with the
#: largest values a field takes (a 1 TB offset, a 10-digit CRC): 1 GiB holds 6 million, e.g. a
#: 1 000-tensor model's master weights and AdamW's two moments row-sharded at world 1 024 (3 million
#: chunks, 0.55 GB) nearly twice over, beside ``meta`` (the caller's JSON, kept small).
MAX_BYTES = 1 << 30
_INTP_MAX = int(np.iinfo(np.intp).max)  # the most bytes numpy can index: an array larger is none
_KEYS = {"format", "version", "crc32", "world", "manager", "layout", "meta", "files", "arrays"}
_CHUNK_KEYS = {"file", "start", "rows", "offset", "bytes", "crc32"}


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def checksum(m: dict[str, Any]) -> int:
    """The CRC-32 of the manifest's content without its ``crc32``: over its canonical JSON (keys
    sorted, no spaces), which any JSON reader can recompute."""
    body = {k: v for k, v in m.items() if k != "crc32"}
    return zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def encode(m: dict[str, Any]) -> bytes:
    """The manifest's file: ``m`` with its checksum; ValueError when it is larger than
    :data:`MAX_BYTES` (no reader would read it)."""
    data = json.dumps({**m, "crc32": checksum(m)}, indent=1, sort_keys=True).encode()
    if len(data) > MAX_BYTES:
        raise ValueError(f"the manifest would hold {len(data)} bytes, more than a manifest may ({MAX_BYTES}): "
                         "fewer arrays, fewer ranks, or a smaller meta")
    return data


def cover(chunks: list[dict[str, Any]], rows: int) -> None:
    """ValueError unless ``chunks`` (sorted by start, then rows) hold rows ``[0, rows)`` each
    exactly once: no gap, no overlap, nothing past the end."""
    covered = 0
    for c in chunks:
        if c["start"] != covered:
            raise ValueError(f"rows [{min(covered, c['start'])}, {max(covered, c['start'])}) are held by no "
                             "chunk or by two")
        covered += c["rows"]
    if covered != rows:
        raise ValueError(f"its chunks hold {covered} of its {rows} rows")


def read(directory: Path) -> dict[str, Any]:
    """The checked manifest of the checkpoint ``directory``: CheckpointError naming the file when
    it is missing, not a regular file (saying what it is), larger than :data:`MAX_BYTES` (not
    read), unreadable, of another format or version, fails its CRC-32, or any field is missing,
    unknown, of the wrong type or out of range (chunks that overlap, leave rows out, or lie
    outside their file included; sizes are Python integers, so no product wraps)."""
    where = directory / NAME
    raw = files.read_capped(where, MAX_BYTES, "manifest",
                            missing=f"{directory} is not a checkpoint, or its save did not finish")
    try:
        m = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the parser goes
        raise CheckpointError(f"{where}: not JSON (truncated or corrupted): {e}") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a lowgrad checkpoint manifest")
    if m.get("version") != VERSION:
        raise CheckpointError(f"{where}: version {m.get('version')!r} is not supported (this lowgrad reads "
                              f"version {VERSION})")
    if m.get("crc32") != checksum(m):
        raise CheckpointError(f"{where}: its CRC-32 does not match its content (edited or corrupted)")
    try:
        _check(m)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: malformed: {e}") from None
    return m


def _natural(what: str, v: Any, limit: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (limit is not None and v >= limit):
        raise ValueError(f"{what} is {v!r}, not an int in [0, {limit if limit is not None else 'inf'})")
    return v


def _keys(what: str, d: Any, keys: set[str]) -> None:
    if not isinstance(d, dict) or set(d) != keys:
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"{what} must hold exactly {sorted(keys)}, holds {got}")


def _check(m: dict[str, Any]) -> None:
    _keys("the manifest", m, _KEYS)
    world = _natural("world", m["world"])
    if world < 1:
        raise ValueError("world is 0")
    ManagerState.at(m["manager"], 0, world)  # TypeError or ValueError for a bad state
    for k in ("layout", "meta", "files", "arrays"):
        if not isinstance(m[k], dict):
            raise TypeError(f"{k} is a {type(m[k]).__name__}, not an object")
    files = m["files"]
    if set(files) != {rank_file(r) for r in range(world)}:
        raise ValueError(f"files are {sorted(files)[:4]}, not one per rank of world {world}")
    for f, size in files.items():
        _natural(f"the size of {f}", size)
    for name, entry in m["arrays"].items():
        what = f"array {name!r}"
        _keys(what, entry, {"dtype", "shape", "chunks"})
        if not isinstance(entry["dtype"], str) or np.dtype(entry["dtype"]).name != entry["dtype"] \
                or np.dtype(entry["dtype"]).hasobject:
            raise ValueError(f"{what}: dtype {entry['dtype']!r} is not a numpy dtype name")
        shape = entry["shape"]
        if not isinstance(shape, list):
            raise TypeError(f"{what}: shape is a {type(shape).__name__}, not a list")
        for d in shape:
            _natural(f"{what}: a dimension", d)
        itemsize = np.dtype(entry["dtype"]).itemsize
        if math.prod(d for d in shape if d) * itemsize > _INTP_MAX:  # numpy's own test of a shape
            raise ValueError(f"{what}: shape {shape} is larger than any numpy array")
        row = math.prod(shape[1:]) * itemsize  # Python integers: a product never wraps
        chunks = entry["chunks"]
        if not isinstance(chunks, list):
            raise TypeError(f"{what}: chunks is a {type(chunks).__name__}, not a list")
        for c in chunks:
            _keys(f"{what}: a chunk", c, _CHUNK_KEYS)
            if c["file"] not in files:
                raise ValueError(f"{what}: a chunk's file {c['file']!r} is not in files")
            start, rows, offset, size = (_natural(f"{what}: a chunk's {k}", c[k])
                                         for k in ("start", "rows", "offset", "bytes"))
            _natural(f"{what}: a chunk's crc32", c["crc32"], 1 << 32)
            if size != rows * row or (not shape and (start, rows) != (0, 1)):
                raise ValueError(f"{what}: the chunk of rows [{start}, {start + rows}) holds {size} bytes, "
                                 f"not {rows * row}")
            if offset + size > files[c["file"]]:
                raise ValueError(f"{what}: the chunk at bytes {offset}..{offset + size} lies past the end "
                                 f"of {c['file']} ({files[c['file']]} bytes)")
        try:
            cover(sorted(chunks, key=lambda c: (c["start"], c["rows"])), shape[0] if shape else 1)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
