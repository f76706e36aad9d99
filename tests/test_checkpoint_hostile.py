"""Manifests and files made to fool ``checkpoint.latest`` and ``load``: a shape whose product
overflows int64 (CRC-32 recomputed), a manifest larger than any real one (a sparse file: nothing
is written), one nested deeper than a parser goes, a FIFO or a device in place of a file, a byte
flipped in a rank file. Each is passed over by ``latest`` (with ``verify=True`` the flipped byte
too), refused by ``load`` on every rank saying what is wrong, and nothing blocks or reads a huge
file."""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from test_checkpoint import Engine, _copy, _refused, _run, _save

import lowgrad as lg
from lowgrad import checkpoint
from lowgrad.checkpoint import manifest

NAME = "master.layers.0.w"


@pytest.fixture
def good(tmp_path: Path) -> Path:
    """A world-2 checkpoint at step 2; the hostile copies below sort after it (same step: the last
    name would win), so ``latest`` returning it means each copy was passed over."""
    _save(tmp_path / "a-good", 2, "scatter_reduce", False)
    return tmp_path / "a-good"


def _one_row_of(shape: list[int]) -> Any:
    def edit(m: dict[str, Any]) -> None:
        m["arrays"][NAME] = {"dtype": "float32", "shape": shape, "chunks": [
            {"file": "rank-00000.bin", "start": 0, "rows": shape[0], "offset": 0, "bytes": 0, "crc32": 0}]}
    return edit


@pytest.mark.parametrize("shape", [[1, 2 ** 62, 4], [1, 2 ** 31, 2 ** 31], [0, 2 ** 62, 4], [1, 2 ** 64]])
def test_a_shape_whose_product_overflows_int64_is_refused(good: Path, shape: list[int]) -> None:
    """np.prod in int64 wraps 2**62 * 4 to 0, so a zero-byte chunk "held" a row: the manifest passed
    its checks, latest() returned it and every load refused it (a resume loop stuck). Python
    integers do not wrap, and a shape no numpy array can have is malformed."""
    bad = _copy(good, good.parent / "b-overflow", _one_row_of(shape))
    with pytest.raises(lg.CheckpointError, match=r"malformed: array 'master.layers.0.w': shape .* is larger than any "
                                                 r"numpy array"):
        checkpoint.read_manifest(bad)
    assert checkpoint.latest(good.parent) == good
    for msg in _refused(bad, 2):
        assert "b-overflow/manifest.json: malformed" in msg


def test_row_bytes_are_exact_past_int64(good: Path) -> None:
    """A row of 2**61 float32 values is 2**63 bytes: more than int64 holds, so the exact size is
    compared (and refused by numpy's limit first, whatever the chunk claims)."""
    bad = _copy(good, good.parent / "b-rows", _one_row_of([1, 2 ** 61]))
    with pytest.raises(lg.CheckpointError, match="larger than any numpy array"):
        checkpoint.read_manifest(bad)


def test_a_huge_manifest_is_refused_without_being_read(good: Path) -> None:
    """A 4 GiB manifest.json (sparse: no byte is written) is passed over by latest() and refused by
    read_manifest naming its size, quickly and without reading it (no allocation near its size)."""
    bad = good.parent / "b-huge"
    shutil.copytree(good, bad)
    with open(bad / "manifest.json", "r+b") as fh:
        fh.truncate(4 << 30)
    began = time.perf_counter()
    tracemalloc.start()
    try:
        with pytest.raises(lg.CheckpointError, match=rf"b-huge/manifest.json: {4 << 30} bytes, more than a manifest "
                                                     rf"may hold \({manifest.MAX_BYTES}\): not read"):
            checkpoint.read_manifest(bad)
        assert checkpoint.latest(good.parent) == good
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20 and time.perf_counter() - began < 5, (peak, time.perf_counter() - began)


def test_a_manifest_is_never_written_larger_than_a_reader_reads(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap is the format's: a save whose manifest would exceed it is refused on every rank and
    publishes nothing, so whatever save writes, read_manifest reads."""
    monkeypatch.setattr(manifest, "MAX_BYTES", 2000)
    with pytest.raises(lg.CheckpointError, match=r"rank 0: ValueError: the manifest would hold \d+ bytes, more "
                                                 r"than a manifest may \(2000\)"):
        _save(tmp_path / "ck", 2, "scatter_reduce", False)
    assert checkpoint.latest(tmp_path) is None and not (tmp_path / "ck").exists()


def test_a_manifest_nested_deeper_than_the_parser_goes_is_refused(good: Path) -> None:
    bad = good.parent / "b-deep"
    shutil.copytree(good, bad)
    (bad / "manifest.json").write_text("[" * 200_000)
    with pytest.raises(lg.CheckpointError, match="b-deep/manifest.json: not JSON"):
        checkpoint.read_manifest(bad)
    assert checkpoint.latest(good.parent) == good


def test_a_fifo_or_a_device_is_reported_as_what_it_is(good: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A FIFO manifest.json (reading it would block), /dev/zero (never ends), a directory: each is
    passed over by latest() with a WARNING naming what it is, and refused by every rank's load
    without blocking; a FIFO rank file too. Only a missing manifest says "missing"."""
    fifo = good.parent / "b-fifo"
    shutil.copytree(good, fifo)
    (fifo / "manifest.json").unlink()
    os.mkfifo(fifo / "manifest.json")
    device = good.parent / "c-device"
    shutil.copytree(good, device)
    (device / "manifest.json").unlink()
    (device / "manifest.json").symlink_to("/dev/zero")
    folder = good.parent / "d-dir"
    shutil.copytree(good, folder)
    (folder / "manifest.json").unlink()
    (folder / "manifest.json").mkdir()
    rank_fifo = good.parent / "e-rank-fifo"
    shutil.copytree(good, rank_fifo)
    (rank_fifo / "rank-00001.bin").unlink()
    os.mkfifo(rank_fifo / "rank-00001.bin")
    (good.parent / "f-not-a-checkpoint").mkdir()  # no manifest: not a checkpoint, nothing said
    with caplog.at_level(logging.WARNING, logger="lowgrad"):
        assert checkpoint.latest(good.parent) == good
    said = {r.getMessage().split(": ")[1].split(" ")[0]: r.getMessage() for r in caplog.records}
    assert sorted(said) == ["b-fifo", "c-device", "d-dir", "e-rank-fifo"], said
    assert "manifest.json is a FIFO (named pipe), not a regular file" in said["b-fifo"]
    assert "manifest.json is a character device, not a regular file" in said["c-device"]
    assert "manifest.json is a directory, not a regular file" in said["d-dir"]
    assert "rank-00001.bin is a FIFO (named pipe), not a regular file" in said["e-rank-fifo"]
    for msg in _refused(fifo, 2):
        assert "b-fifo/manifest.json is a FIFO (named pipe), not a regular file" in msg and "missing" not in msg
    for msg in _refused(rank_fifo, 2):
        assert "e-rank-fifo/rank-00001.bin is a FIFO (named pipe), not a regular file" in msg
    (good.parent / "g-file").write_text("x")
    with pytest.raises(lg.CheckpointError, match="g-file is a regular file, not a directory"):
        checkpoint.read_manifest(good.parent / "g-file")


def _flip(path: Path) -> None:
    f = path / "rank-00001.bin"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 3] ^= 0x01
    f.write_bytes(bytes(raw))


def test_latest_with_verify_is_the_newest_checkpoint_that_loads(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A byte flipped in a rank file of the newest checkpoint: latest() still returns it (it reads
    no chunk), latest(verify=True) the newest whose every chunk passes its CRC-32, which loads;
    verify() names the file and the chunk."""
    _save(tmp_path / "step-1", 2, "scatter_reduce", False, steps=1)
    _save(tmp_path / "step-2", 2, "scatter_reduce", False, steps=2)
    _save(tmp_path / "step-3", 2, "scatter_reduce", False, steps=3)
    _flip(tmp_path / "step-3")
    _flip(tmp_path / "step-2")
    assert checkpoint.latest(tmp_path) == tmp_path / "step-3"
    with caplog.at_level(logging.WARNING, logger="lowgrad"):
        assert checkpoint.latest(tmp_path, verify=True) == tmp_path / "step-1"
    assert [r.getMessage().split(": ")[1] for r in caplog.records] == ["step-3 passed over", "step-2 passed over"]
    with pytest.raises(lg.CheckpointError, match=r"step-3/rank-00001.bin: the chunk of '.*' \(rows \[\d+, \d+\), "
                                                 r"bytes \d+\.\.\d+\) fails its CRC-32"):
        checkpoint.verify(tmp_path / "step-3")
    assert checkpoint.verify(tmp_path / "step-1") == checkpoint.read_manifest(tmp_path / "step-1")

    def resume(c: Any) -> int:
        e = Engine(c, "scatter_reduce", False)
        last = checkpoint.latest(tmp_path, verify=True)
        assert last is not None
        checkpoint.load(last, e.gm, e.arrays())
        step = int(e.gm.state_dict()["step"])
        e.gm.close()
        return step
    assert _run(2, resume) == [1, 1]
    (tmp_path / "step-1" / "rank-00000.bin").write_bytes(b"")  # the last one too: none loads
    assert checkpoint.latest(tmp_path, verify=True) is None


def test_verify_reads_a_chunk_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk larger than verify's piece is checked piece by piece (bounded memory), the same
    verdict as one read."""
    _save(tmp_path / "ck", 1, "scatter_reduce", False)
    monkeypatch.setattr(checkpoint.store, "_PIECE", 7)
    checkpoint.verify(tmp_path / "ck")
    raw = bytearray((tmp_path / "ck" / "rank-00000.bin").read_bytes())
    raw[-1] ^= 0x80
    (tmp_path / "ck" / "rank-00000.bin").write_bytes(bytes(raw))
    with pytest.raises(lg.CheckpointError, match="fails its CRC-32"):
        checkpoint.verify(tmp_path / "ck")


def test_the_manifest_cap_holds_a_large_run(tmp_path: Path) -> None:
    """The cap's comment: about 180 bytes a chunk at the largest field values, so 3 000 row-sharded
    arrays at world 1 024 fit nearly twice over."""
    chunk = {"file": "rank-01023.bin", "start": 10 ** 9, "rows": 10 ** 9, "offset": 10 ** 12, "bytes": 10 ** 12,
             "crc32": 2 ** 32 - 1}
    one = manifest.encode({"arrays": {"model.layers.79.mlp.down_proj.weight.exp_avg_sq": {
        "dtype": "float32", "shape": [8192, 29568], "chunks": [chunk] * 1024}}})
    per_chunk = len(one) / 1024
    assert 170 < per_chunk < 190
    assert 1.9 * 3000 * 1024 * per_chunk < manifest.MAX_BYTES
    assert json.loads(one)  # what encode writes, a reader reads


def test_a_manifest_that_grows_while_read_is_refused(good: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A published manifest never changes: one longer than its size when opened (a writer at work)
    is refused, not parsed in part."""
    real = os.fstat

    def earlier(fd: int) -> Any:
        st = real(fd)
        return os.stat_result((st.st_mode, *st[1:6], st.st_size - 10, *st[7:]))
    monkeypatch.setattr(checkpoint.files.os, "fstat", earlier)
    with pytest.raises(lg.CheckpointError, match="a-good/manifest.json: grew while it was read"):
        checkpoint.read_manifest(good)
