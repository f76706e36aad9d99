"""lowgrad.checkpoint without a framework: an engine of numpy (SGD with momentum on float32 master
rows) drives a manager and checkpoints it with its arrays. A resume at the same world is bit for
bit the uninterrupted run (weights, momentum, manager step, the SR noise of the next step's
shards) for every strategy, with and without offload; a checkpoint saved at world N loads at any
world M with every rank's rows equal to the saved arrays' and runs on as a world-M run started
from that state; a save that fails on one rank publishes nothing and leaves the previous
checkpoint; a missing, half-written, truncated, corrupted or foreign checkpoint is refused on every
rank naming the file, with nothing changed."""
from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import zlib
from pathlib import Path
from typing import Any, cast

import ml_dtypes
import numpy as np
import pytest
from helpers import strategy_configs

import lowgrad as lg
from lowgrad import checkpoint
from lowgrad.checkpoint import Rows

LAYOUT = lg.Layout(block=(lg.ParamSpec("w", (12, 4)), lg.ParamSpec("b", (12,))),
                   non_block=(lg.ParamSpec("e", (24, 4)),), num_layers=2)
SPECS = {f"layers.{l}.{s.name}": s for l in range(LAYOUT.num_layers) for s in LAYOUT.block} | {
    s.name: s for s in LAYOUT.non_block}
M = 2
CONFIGS = strategy_configs()


def _grad(shape: tuple[int, ...], *key: Any) -> np.ndarray:
    rng = np.random.default_rng([abs(hash(str(key))) % (1 << 32)])
    return (rng.standard_normal(shape) * 0.1).astype(ml_dtypes.bfloat16)


class Engine:
    """A rank of a framework-free training loop: the manager's protocol with numpy gradients, SGD
    with momentum on this rank's float32 master rows of every parameter."""

    def __init__(self, comm: Any, strategy: str, offload: bool, stats: bool = False) -> None:
        self.gm = lg.create_gradient_manager(LAYOUT, comm, strategy=strategy, offload=offload, seed=11, stats=stats)
        self.rank, self.world = comm.rank, comm.world
        self.master = {n: _grad(s.shape, "init", n).astype(np.float32)[self.rows(n)] for n, s in SPECS.items()}
        self.momentum = {n: np.zeros_like(v) for n, v in self.master.items()}
        self.last: dict[str, np.ndarray] = {}

    def rows(self, name: str) -> slice:
        per = SPECS[name].shape[0] // self.world
        return slice(self.rank * per, (self.rank + 1) * per)

    def step(self, s: int) -> None:
        gm = self.gm
        for m in range(M):
            gm.start_micro_step(None, m, M)
            for spec in LAYOUT.non_block:
                t, acc = gm.non_block_full(spec.name, None)
                self._write(t, _grad(spec.shape, s, m, self.rank, spec.name), acc)
                gm.notify_non_block(spec.name, None)
            for layer in reversed(range(LAYOUT.num_layers)):
                dw, acc = gm.block_full(layer, None)
                for spec in LAYOUT.block:
                    self._write(dw[spec.name], _grad(spec.shape, s, m, self.rank, layer, spec.name), acc)
                gm.notify_block(layer, None)
            gm.end_micro_step(None)
        shards = {f"layers.{l}.{b.name}": gm.block_shard(l, None)[b.name] for l in range(LAYOUT.num_layers)
                  for b in LAYOUT.block}
        shards |= {s.name: gm.non_block_shard(s.name, None) for s in LAYOUT.non_block}
        self.last = {n: t.numpy().copy() for n, t in shards.items()}
        for n, g in self.last.items():
            self.momentum[n] = np.float32(0.9) * self.momentum[n] + g.astype(np.float32)
            self.master[n] = self.master[n] - np.float32(0.01) * self.momentum[n]

    @staticmethod
    def _write(t: lg.Tensor, g: np.ndarray, accumulate: bool) -> None:
        view = t.numpy().reshape(g.shape)
        view[...] = (view.astype(np.float32) + g.astype(np.float32)).astype(ml_dtypes.bfloat16) if accumulate else g

    def arrays(self) -> dict[str, Rows]:
        out = {}
        for n, s in SPECS.items():
            start = self.rows(n).start
            out[f"master.{n}"] = Rows(self.master[n], s.shape, start)
            out[f"momentum.{n}"] = Rows(self.momentum[n], s.shape, start)
        return out

    def apply(self, arrays: dict[str, np.ndarray]) -> None:
        for n in SPECS:
            self.master[n], self.momentum[n] = arrays[f"master.{n}"], arrays[f"momentum.{n}"]

    def snapshot(self) -> dict[str, Any]:
        return {"master": {n: v.copy() for n, v in self.master.items()},
                "momentum": {n: v.copy() for n, v in self.momentum.items()},
                "last": self.last, "state": self.gm.state_dict()}


def _run(world: int, job: Any) -> list[Any]:
    return lg.run_threads(world, job, backend="host", timeout=60)


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["state"] == b["state"]
    for part in ("master", "momentum", "last"):
        assert a[part].keys() == b[part].keys()
        for n in a[part]:
            assert a[part][n].tobytes() == b[part][n].tobytes(), (part, n)


def _save(root: Path, world: int, strategy: str, offload: bool, steps: int = 2) -> list[dict[str, Any]]:
    """A world-``world`` run of ``steps`` steps checkpointed at ``root``; each rank's snapshot."""
    def job(c: Any) -> dict[str, Any]:
        e = Engine(c, strategy, offload)
        for s in range(steps):
            e.step(s)
        checkpoint.save(root, e.gm, e.arrays(), meta={"data_position": steps})
        out = e.snapshot()
        e.gm.close()
        return out
    return _run(world, job)


def _full(snaps: list[dict[str, Any]], part: str) -> dict[str, np.ndarray]:
    return {n: np.concatenate([s[part][n] for s in snaps]) for n in SPECS}


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize(("strategy", "offload"), CONFIGS)
def test_a_resume_at_the_same_world_is_the_uninterrupted_run(tmp_path: Path, world: int, strategy: str,
                                                             offload: bool) -> None:
    def straight(c: Any) -> dict[str, Any]:
        e = Engine(c, strategy, offload)
        for s in range(4):
            e.step(s)
        out = e.snapshot()
        e.gm.close()
        return out

    def resumed(c: Any) -> dict[str, Any]:
        e = Engine(c, strategy, offload)  # a fresh process: initial weights, step 0
        found = checkpoint.load(tmp_path / "ck", e.gm, e.arrays())
        assert found.meta == {"data_position": 2} and found.world == world
        e.apply(found.arrays)
        for s in range(2, 4):
            e.step(s)
        out = e.snapshot()
        e.gm.close()
        return out

    _save(tmp_path / "ck", world, strategy, offload)
    for a, b in zip(_run(world, straight), _run(world, resumed)):
        _same(a, b)


PAIRS = [(n, m) for n in (1, 2, 3, 4) for m in (1, 2, 3, 4) if n != m]


@pytest.mark.parametrize(("saved", "resumed"), PAIRS)
def test_a_checkpoint_loads_at_any_world(tmp_path: Path, saved: int, resumed: int) -> None:
    """Rows of every array equal the saved ones wherever they were; the manager's seed and step
    follow; the run then equals a world-``resumed`` run given the same state by hand."""
    strategy, offload = CONFIGS[(saved * 4 + resumed) % len(CONFIGS)]  # every configuration over the pairs
    snaps = _save(tmp_path / "ck", saved, strategy, offload)
    full = {part: _full(snaps, part) for part in ("master", "momentum")}

    def from_checkpoint(c: Any) -> dict[str, Any]:
        e = Engine(c, strategy, offload)
        e.apply(checkpoint.load(tmp_path / "ck", e.gm, e.arrays()).arrays)
        for part in ("master", "momentum"):
            for n in SPECS:
                assert getattr(e, part)[n].tobytes() == full[part][n][e.rows(n)].tobytes(), (part, n)
        assert {k: v for k, v in e.gm.state_dict().items() if k not in ("rank", "world")} == \
            {k: v for k, v in snaps[0]["state"].items() if k not in ("rank", "world")}
        e.step(2)
        out = e.snapshot()
        e.gm.close()
        return out

    def by_hand(c: Any) -> dict[str, Any]:
        e = Engine(c, strategy, offload)
        e.gm.load_state_dict({**snaps[0]["state"], "rank": c.rank, "world": c.world})
        e.master = {n: full["master"][n][e.rows(n)].copy() for n in SPECS}
        e.momentum = {n: full["momentum"][n][e.rows(n)].copy() for n in SPECS}
        e.step(2)
        out = e.snapshot()
        e.gm.close()
        return out

    for a, b in zip(_run(resumed, from_checkpoint), _run(resumed, by_hand)):
        _same(a, b)


def _reseal(p: Path, m: dict[str, Any]) -> None:
    """Write ``m`` as the manifest of ``p`` with its CRC-32 as documented: over the canonical JSON
    (sorted keys, no spaces) of everything but ``crc32`` (a foreign or malformed manifest that is
    not merely corrupted)."""
    body = {k: v for k, v in m.items() if k != "crc32"}
    m["crc32"] = zlib.crc32(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    (p / "manifest.json").write_text(json.dumps(m))


def _refused(path: Path, world: int, strategy: str = "scatter_reduce", layout: lg.Layout = LAYOUT) -> list[str]:
    """Each rank's CheckpointError message from loading ``path``, having checked nothing changed."""
    def job(c: Any) -> str:
        e = Engine(c, strategy, False)
        if layout is not LAYOUT:
            e.gm.close()
            e.gm = lg.create_gradient_manager(layout, c, strategy=strategy, seed=11)
        before = (e.gm.state_dict(), e.snapshot())
        with pytest.raises(lg.CheckpointError) as info:
            checkpoint.load(path, e.gm, e.arrays())
        assert e.gm.state_dict() == before[0]
        _same(e.snapshot(), before[1])
        e.gm.close()
        return str(info.value)
    return _run(world, job)


def test_broken_and_foreign_checkpoints_are_refused_naming_the_file(tmp_path: Path) -> None:
    good = tmp_path / "good"
    _save(good, 2, "scatter_reduce", False)

    def broken(name: str, change: Any) -> Path:
        p = tmp_path / name
        shutil.copytree(good, p)
        change(p)
        return p

    def flip(p: Path) -> None:
        f = p / "rank-00001.bin"
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        f.write_bytes(bytes(raw))

    def truncate(p: Path) -> None:
        f = p / "rank-00000.bin"
        f.write_bytes(f.read_bytes()[:-8])

    def edit_manifest(**changes: Any) -> Any:
        def edit(p: Path) -> None:
            m = json.loads((p / "manifest.json").read_text())
            for k, v in changes.items():
                m[k] = v(m[k])
            _reseal(p, m)
        return edit

    cases = {
        "no manifest (a save cut short)": (broken("half", lambda p: (p / "manifest.json").unlink()),
                                          "manifest.json is missing"),
        "manifest cut": (broken("cut", lambda p: (p / "manifest.json").write_bytes(
            (p / "manifest.json").read_bytes()[:100])), "not JSON"),
        "a flipped bit": (broken("flip", flip), "rank-00001.bin: the chunk of"),
        "a truncated file": (broken("trunc", truncate), "rank-00000.bin"),
        "a missing file": (broken("gone", lambda p: (p / "rank-00001.bin").unlink()), "rank-00001.bin is missing"),
        "another version": (broken("ver", edit_manifest(version=lambda v: 99)), "version 99"),
        "another model": (broken("model", edit_manifest(layout=lambda v: {**v, "num_layers": 3})), "another model"),
    }
    for what, (path, needle) in cases.items():
        for msg in _refused(path, 2):
            assert needle in msg, (what, msg)
    assert any("CRC-32" in m for m in _refused(tmp_path / "flip", 2))
    for msg in _refused(tmp_path / "trunc", 3):  # a rank whose rows are elsewhere is told too
        assert "rank-00000.bin" in msg
    for msg in _refused(good, 2, strategy="all_to_all"):
        assert "state strategy 'scatter_reduce' does not match this manager's 'all_to_all'" in msg
    other = lg.Layout(block=LAYOUT.block, non_block=(lg.ParamSpec("e", (12, 4)),), num_layers=2)
    for msg in _refused(good, 2, layout=other):
        assert "another model" in msg
    assert all("is not a checkpoint" in m for m in _refused(tmp_path / "nowhere", 1))


def test_a_save_that_fails_on_one_rank_publishes_nothing(tmp_path: Path) -> None:
    """Rank 1 cannot write its file: every rank raises, no checkpoint appears, the previous one
    stays the latest and loads; the next save under the same name succeeds."""
    _save(tmp_path / "step-1", 2, "scatter_reduce", False, steps=1)
    real = checkpoint.durable.write_file

    def failing(path: Path, chunks: list[Any]) -> None:
        if path.name == "rank-00001.bin":
            raise OSError(28, "No space left on device")
        real(path, chunks)

    checkpoint.durable.write_file = failing  # type: ignore[assignment]
    try:
        with pytest.raises(lg.CheckpointError, match="rank 1: OSError.*No space left"):
            _save(tmp_path / "step-2", 2, "scatter_reduce", False)
    finally:
        checkpoint.durable.write_file = real  # type: ignore[assignment]
    assert not (tmp_path / "step-2").exists() and len(_partials(tmp_path)) == 1
    assert checkpoint.latest(tmp_path) == tmp_path / "step-1"
    _save(tmp_path / "step-2", 2, "scatter_reduce", False)  # the leftover is cleared
    assert checkpoint.latest(tmp_path) == tmp_path / "step-2" and not _partials(tmp_path)
    with pytest.raises(lg.CheckpointError, match="exists already"):
        _save(tmp_path / "step-2", 2, "scatter_reduce", False)


def _partials(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".partial"))


def test_the_manifest_describes_every_chunk(tmp_path: Path) -> None:
    """The documented format: rank files of raw chunks, each at its offset with its CRC-32."""
    snaps = _save(tmp_path / "ck", 3, "all_to_all", False)
    m = checkpoint.read_manifest(tmp_path / "ck")
    assert m["world"] == 3 and m["manager"]["step"] == 2
    assert set(m["files"]) == {f"rank-0000{r}.bin" for r in range(3)}
    entry = m["arrays"]["master.layers.1.w"]
    assert entry["dtype"] == "float32" and entry["shape"] == [12, 4]
    assert [c["start"] for c in entry["chunks"]] == [0, 4, 8]
    for r, c in enumerate(entry["chunks"]):
        raw = (tmp_path / "ck" / c["file"]).read_bytes()[c["offset"]:c["offset"] + c["bytes"]]
        assert zlib.crc32(raw) == c["crc32"] and raw == snaps[r]["master"]["layers.1.w"].tobytes()
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary left behind


def test_bad_arguments_change_nothing(tmp_path: Path) -> None:
    """A bad argument is a CheckpointError (the one kind a save or load raises) chained to what the
    check raised, before anything is written or changed."""
    def job(c: Any) -> None:
        e = Engine(c, "scatter_reduce", False)
        with pytest.raises(lg.CheckpointError, match="rank 0: TypeError: save: arrays must map str names to "
                                                     "lowgrad.checkpoint.Rows") as info:
            checkpoint.save(tmp_path / "x", e.gm, {"a": np.zeros(3)})  # type: ignore[dict-item]
        assert isinstance(info.value.__cause__, TypeError)
        with pytest.raises(lg.CheckpointError, match="rank 0: TypeError: Object of type object is not JSON"):
            checkpoint.save(tmp_path / "x", e.gm, e.arrays(), meta={"bad": object()})
        with pytest.raises(lg.CheckpointError, match="rank 0: TypeError: read: arrays must map"):
            checkpoint.load(tmp_path / "x", e.gm, [])  # type: ignore[arg-type]
        e.gm.start_micro_step(None, 0, 2)
        with pytest.raises(lg.CheckpointError, match="rank 0: ProtocolError") as info:
            checkpoint.save(tmp_path / "x", e.gm, e.arrays())
        assert isinstance(info.value.__cause__, lg.ProtocolError)
        e.gm.close()
    _run(1, job)
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="does not fit"):
        Rows(np.zeros((3, 2)), (4, 2), 2)


def test_one_ranks_bad_argument_is_a_checkpoint_error_on_every_rank(tmp_path: Path) -> None:
    """One rank's meta that JSON cannot hold (a TypeError there, CommAbortedError on the other
    before), its bad arrays, its save or load inside a step: CheckpointError on every rank naming
    that rank, nothing written, nothing changed; then the corrected call succeeds."""
    _save(tmp_path / "good", 2, "scatter_reduce", False, steps=1)

    def job(c: Any) -> list[str]:
        e = Engine(c, "scatter_reduce", False)
        before = (e.gm.state_dict(), e.snapshot())
        said = []
        for call in (lambda: checkpoint.save(tmp_path / "x", e.gm, e.arrays(),
                                             meta={"at": object() if c.rank == 1 else 1}),
                     lambda: checkpoint.save(tmp_path / "x", e.gm, e.arrays() if c.rank == 0 else {"a": 1}),
                     lambda: checkpoint.load(tmp_path / "good", e.gm, e.arrays() if c.rank == 0 else None)):
            with pytest.raises(lg.CheckpointError) as info:
                call()
            said.append(str(info.value))
        assert e.gm.state_dict() == before[0]
        _same(e.snapshot(), before[1])
        checkpoint.save(tmp_path / "x", e.gm, e.arrays())  # the corrected retries
        checkpoint.load(tmp_path / "good", e.gm, e.arrays())
        before = (e.gm.state_dict(), e.snapshot())
        if c.rank == 1:
            e.gm.start_micro_step(None, 0, 2)  # rank 1 in the middle of a step
        for call in (lambda: checkpoint.save(tmp_path / "y", e.gm, e.arrays()),
                     lambda: checkpoint.load(tmp_path / "good", e.gm, e.arrays())):
            with pytest.raises(lg.CheckpointError) as info:
                call()
            said.append(str(info.value))
        if c.rank == 0:
            assert e.gm.state_dict() == before[0]
        for n in SPECS:
            assert e.master[n].tobytes() == before[1]["master"][n].tobytes()
        e.gm.close()
        return said
    first, second = _run(2, job)
    assert first == second
    assert "rank 1: TypeError: Object of type object is not JSON serializable" in first[0]
    assert "rank 1: TypeError: save: arrays must map str names" in first[1]
    assert "rank 1: TypeError: read: arrays must map str names" in first[2]
    assert "rank 1: ProtocolError" in first[3] and "rank 1: ProtocolError" in first[4]
    assert all("rank 0" not in m for m in first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good", "x"]  # the retry's; nothing of the refusals


def test_a_layout_mismatch_names_the_parameter(tmp_path: Path) -> None:
    _save(tmp_path / "ck", 2, "scatter_reduce", False)
    block, non_block = LAYOUT.block, LAYOUT.non_block
    cases = [
        (lg.Layout(block=block, non_block=(lg.ParamSpec("e", (12, 4)),), num_layers=2),
         "another model: non-block parameter 'e' is [24, 4] there, [12, 4] in this manager"),
        (lg.Layout(block=(block[0], lg.ParamSpec("bias", (12,))), non_block=non_block, num_layers=2),
         "another model: this manager's block parameter 'bias' is not in it"),
        (lg.Layout(block=block[:1], non_block=non_block, num_layers=2),
         "another model: its block parameter 'b' is not this manager's"),
        (lg.Layout(block=block[::-1], non_block=non_block, num_layers=2),
         "another model: its block parameters are in another order: ['w', 'b']"),
        (lg.Layout(block=block, non_block=non_block, num_layers=4),
         "another model: its number of layers is 2, this manager's 4"),
    ]
    for layout, needle in cases:
        for msg in _refused(tmp_path / "ck", 2, layout=layout):
            assert needle in msg, (needle, msg)


def _copy(good: Path, to: Path, edit: Any) -> Path:
    """A copy of the checkpoint ``good`` at ``to`` whose manifest ``edit`` changed (then resealed)."""
    shutil.copytree(good, to)
    m = json.loads((to / "manifest.json").read_text())
    edit(m)
    _reseal(to, m)
    return to


def test_an_error_of_any_kind_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Whatever ``fn`` raises on one rank (a KeyError here) is a CheckpointError on every rank,
    chained to the error on the rank that raised it: no rank is left in the collective."""
    def job(c: Any) -> tuple[str, str | None]:
        def fn() -> int:
            if c.rank == 1:
                raise KeyError("crc32")
            return 1
        with pytest.raises(lg.CheckpointError) as info:
            checkpoint.agree(c, fn, "load /x")
        cause = info.value.__cause__
        return str(info.value), type(cause).__name__ if cause else None
    assert _run(2, job) == [("load /x: rank 1: KeyError: 'crc32'", None), ("load /x: rank 1: KeyError: 'crc32'",
                                                                         "KeyError")]


def test_a_malformed_manifest_is_refused_on_every_rank_naming_the_field(tmp_path: Path) -> None:
    """Each manifest below has a valid CRC-32 (another writer's mistake, not corruption): the whole
    schema is checked before any byte is read, so a chunk only rank 1 reads fails on both ranks."""
    good = tmp_path / "good"
    _save(good, 2, "scatter_reduce", False)
    name = "master.layers.0.w"

    def chunk(m: dict[str, Any], i: int) -> dict[str, Any]:
        return cast(dict[str, Any], m["arrays"][name]["chunks"][i])

    def twice(m: dict[str, Any]) -> None:  # rows [0, 6) twice, [6, 12) never (the review's r2)
        m["arrays"][name]["chunks"][1] = dict(chunk(m, 0))

    cases = {
        "no_crc": (lambda m: chunk(m, 1).pop("crc32"), "a chunk must hold exactly"),
        "twice": (twice, "held by no chunk or by two"),
        "gap": (lambda m: m["arrays"][name]["chunks"].pop(1), "hold 6 of its 12 rows"),
        "bytes": (lambda m: chunk(m, 1).update(bytes=chunk(m, 1)["bytes"] - 4), "not 96"),
        "file": (lambda m: chunk(m, 1).update(file="../../etc/passwd"), "is not in files"),
        "past_end": (lambda m: chunk(m, 1).update(offset=10 ** 9), "lies past the end of rank-00001.bin"),
        "world": (lambda m: m.update(world=True), "world is True"),
        "files": (lambda m: m["files"].pop("rank-00001.bin"), "not one per rank of world 2"),
        "extra": (lambda m: m.update(extra=1), "the manifest must hold exactly"),
        "dtype": (lambda m: m["arrays"][name].update(dtype="object"), "not a numpy dtype name"),
        "step": (lambda m: m["manager"].update(step=-1), "step"),
    }
    for what, (edit, needle) in cases.items():
        p = _copy(good, tmp_path / what, edit)
        for msg in _refused(p, 2):
            assert "manifest.json: malformed" in msg and needle in msg, (what, msg)
        assert checkpoint.latest(tmp_path) == good  # whichever name sorts last, a malformed one is passed over
    for msg in _refused(tmp_path / "no_crc", 3):
        assert "rank 0: " in msg and "rank 2: " in msg


def test_an_edited_manifest_fails_its_crc(tmp_path: Path) -> None:
    """The manifest's own CRC-32: a changed base seed (silently other SR noise) is refused on every
    rank naming the file, and latest() passes the checkpoint over."""
    good = tmp_path / "a"
    _save(good, 2, "scatter_reduce", False)
    shutil.copytree(good, tmp_path / "b")
    text = (tmp_path / "b" / "manifest.json").read_text()
    seed = json.loads(text)["manager"]["base_seed"]
    (tmp_path / "b" / "manifest.json").write_text(text.replace(f'"base_seed": {seed}', f'"base_seed": {seed + 2}'))
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["manager"]["base_seed"] == seed + 2
    for msg in _refused(tmp_path / "b", 2):
        assert "b/manifest.json: its CRC-32 does not match its content" in msg
    assert checkpoint.latest(tmp_path) == good


def test_latest_passes_over_a_checkpoint_missing_a_file(tmp_path: Path) -> None:
    """The newest whole checkpoint: one whose file is missing or of another size than listed is
    passed over, whatever its step (the review's r9)."""
    _save(tmp_path / "step-2", 2, "scatter_reduce", False, steps=2)
    _save(tmp_path / "step-9", 2, "scatter_reduce", False, steps=3)
    (tmp_path / "step-9" / "rank-00001.bin").unlink()
    assert checkpoint.latest(tmp_path) == tmp_path / "step-2"
    _save(tmp_path / "step-8", 2, "scatter_reduce", False, steps=3)
    assert checkpoint.latest(tmp_path) == tmp_path / "step-8"
    with open(tmp_path / "step-8" / "rank-00000.bin", "ab") as fh:
        fh.write(b"x")
    assert checkpoint.latest(tmp_path) == tmp_path / "step-2"


def test_ranks_that_read_different_checkpoints_are_refused(tmp_path: Path) -> None:
    """Each rank's verdict names the manifest it read: two ranks given two whole checkpoints (each
    rank's own latest() differed) refuse both, on every rank, with nothing changed."""
    _save(tmp_path / "a", 2, "scatter_reduce", False, steps=1)
    _save(tmp_path / "b", 2, "scatter_reduce", False, steps=2)

    def job(c: Any) -> str:
        e = Engine(c, "scatter_reduce", False)
        before = e.gm.state_dict()
        with pytest.raises(lg.CheckpointError) as info:
            checkpoint.load(tmp_path / ("a" if c.rank == 0 else "b"), e.gm, e.arrays())
        assert e.gm.state_dict() == before
        e.gm.close()
        return str(info.value)
    for msg in _run(2, job):
        assert "the ranks read different checkpoints" in msg and "step 1" in msg and "step 2" in msg, msg
    (tmp_path / "link").symlink_to(tmp_path / "a")  # one checkpoint by two paths is one checkpoint

    def by_two_paths(c: Any) -> int:
        e = Engine(c, "scatter_reduce", False)
        checkpoint.load(tmp_path / ("a" if c.rank == 0 else "link"), e.gm, e.arrays())
        step = int(e.gm.state_dict()["step"])
        e.gm.close()
        return step
    assert _run(2, by_two_paths) == [1, 1]


def test_two_saves_to_one_path_at_once_never_mix(tmp_path: Path) -> None:
    """Two jobs save under one name at the same time, both having written their files before either
    publishes: each has its own temporary directory, so one publishes its own whole checkpoint and
    the other fails; the published one loads."""
    meet = threading.Barrier(2, timeout=30)
    real = checkpoint.durable.publish

    def publish(tmp: Path, final: Path) -> None:
        meet.wait()
        real(tmp, final)

    results: dict[int, Any] = {}

    def job(steps: int) -> None:
        try:
            results[steps] = _save(tmp_path / "ck", 1, "scatter_reduce", False, steps=steps)
        except lg.CheckpointError as e:
            results[steps] = e
    checkpoint.durable.publish = publish  # type: ignore[assignment]
    try:
        jobs = [threading.Thread(target=job, args=(s,)) for s in (1, 2)]
        for t in jobs:
            t.start()
        for t in jobs:
            t.join()
    finally:
        checkpoint.durable.publish = real  # type: ignore[assignment]
    failed = [s for s, r in results.items() if isinstance(r, lg.CheckpointError)]
    assert len(failed) == 1, results
    won = 3 - failed[0]

    def load(c: Any) -> None:
        e = Engine(c, "scatter_reduce", False)
        found = checkpoint.load(tmp_path / "ck", e.gm, e.arrays())
        assert found.meta == {"data_position": won} and e.gm.state_dict()["step"] == won
        for n in SPECS:
            assert found.arrays[f"master.{n}"].tobytes() == results[won][0]["master"][n].tobytes()
        e.gm.close()
    _run(1, load)


def test_stale_partials_are_removed_and_a_running_one_stays(tmp_path: Path) -> None:
    """A save removes the temporary directories in its parent that no running save holds (a save
    that crashed or failed); one locked by a save in progress, and directories not of this form,
    stay."""
    stale = tmp_path / ".old.0123456789abcdef.partial"
    stale.mkdir()
    (stale / "rank-00000.bin").write_bytes(b"x")
    running = tmp_path / ".other.fedcba9876543210.partial"
    mine = tmp_path / ".mine.partial"
    mine.mkdir()
    fd = checkpoint.durable.claim(running)
    try:
        _save(tmp_path / "ck", 2, "scatter_reduce", False, steps=1)
        assert _partials(tmp_path) == sorted([running.name, mine.name])
    finally:
        checkpoint.durable.release(fd)
    _save(tmp_path / "ck2", 1, "scatter_reduce", False, steps=1)
    assert _partials(tmp_path) == [mine.name]


def test_without_flock_a_save_goes_on_and_removes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without ``flock`` (ENOLCK): the save publishes, no leftover is removed (nothing
    tells it from a save in progress)."""
    stale = tmp_path / ".old.0123456789abcdef.partial"
    stale.mkdir()

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(checkpoint.durable.fcntl, "flock", no_flock)
    _save(tmp_path / "ck", 2, "scatter_reduce", False, steps=1)
    assert checkpoint.latest(tmp_path) == tmp_path / "ck" and _partials(tmp_path) == [stale.name]


def test_a_new_parent_is_made_durable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each directory a save creates is fsynced in its parent; an fsync of the parent that fails
    after the rename is a warning: the checkpoint is published, loads, and its name is taken."""
    real = checkpoint.durable.fsync_dir
    synced: list[Path] = []

    def record(path: Path) -> None:
        synced.append(path)
        real(path)
    monkeypatch.setattr(checkpoint.durable, "fsync_dir", record)
    _save(tmp_path / "a" / "b" / "ck", 1, "scatter_reduce", False, steps=1)
    assert tmp_path in synced and tmp_path / "a" in synced and synced[-1] == tmp_path / "a" / "b"

    def failing(path: Path) -> None:
        if path == tmp_path / "a" / "b":
            raise OSError(5, "Input/output error")
        real(path)
    monkeypatch.setattr(checkpoint.durable, "fsync_dir", failing)
    with pytest.warns(RuntimeWarning, match="ck2: published, but its parent directory could not be fsynced"):
        _save(tmp_path / "a" / "b" / "ck2", 1, "scatter_reduce", False, steps=1)
    assert checkpoint.latest(tmp_path / "a" / "b") == tmp_path / "a" / "b" / "ck2"
    _run(1, lambda c: checkpoint.read(tmp_path / "a" / "b" / "ck2", Engine(c, "scatter_reduce", False).gm,
                                      Engine(c, "scatter_reduce", False).arrays()))
