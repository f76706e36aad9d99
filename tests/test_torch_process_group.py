"""``lowgrad.torch.init_process_group``: the process group DCP needs at world > 1 starts where the
ranks are processes (two processes here, with a stand-in for ``lowgrad.from_env``'s communicator,
which needs GPUs) and DCP then writes each rank's rows; ranks that are threads of one process
(``run_threads``, the host backend) are refused on every rank before torch is called, where
``torch.distributed.init_process_group`` from two threads waits for ever. Skipped without torch."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch", reason="lowgrad.torch needs PyTorch: pip install \".[torch]\"")
import torch.distributed as dist  # noqa: E402

import lowgrad as lg  # noqa: E402
import lowgrad.torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_group() -> Iterator[None]:
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _torch_not_called(monkeypatch: pytest.MonkeyPatch) -> None:
    def called(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.distributed.init_process_group was called")

    monkeypatch.setattr(dist, "init_process_group", called)


@pytest.mark.timeout(60)  # the thing refused here hangs
def test_ranks_as_threads_are_refused_on_every_rank_before_torch_is_called(monkeypatch: pytest.MonkeyPatch,
                                                                            no_group: None) -> None:
    _torch_not_called(monkeypatch)

    def rank(comm: lg.HostCommunicator) -> str:
        assert comm.ranks_are_threads and comm.split(0).ranks_are_threads  # a split's ranks are threads too
        with pytest.raises(lg.CheckpointError, match=f"rank {comm.rank} of 2 is a thread of this process") as info:
            lowgrad.torch.init_process_group(comm)
        return str(info.value)

    said = lg.run_threads(2, rank, backend="host", timeout=30)
    assert all("lowgrad.torch.save_checkpoint" in s and "torchrun" in s for s in said), said
    assert not dist.is_initialized()


def test_bad_arguments_change_nothing(monkeypatch: pytest.MonkeyPatch, no_group: None) -> None:
    _torch_not_called(monkeypatch)
    comm = SimpleNamespace(rank=0, world=2, ranks_are_threads=False, timeout=30.0)
    with pytest.raises(TypeError, match="backend must be a str"):
        lowgrad.torch.init_process_group(comm, backend=None)  # type: ignore[arg-type]
    assert not dist.is_initialized()


def test_world_1_starts_the_group_once_and_refuses_another(tmp_path: Path, no_group: None) -> None:
    """One thread (world 1) may have the group; a second call with the same ranks is harmless, one
    with another rank or world is refused."""
    def rank(comm: lg.HostCommunicator) -> tuple[int, int]:
        lowgrad.torch.init_process_group(comm, init_method=f"file://{tmp_path}/rendezvous")
        lowgrad.torch.init_process_group(comm)  # already there: nothing happens
        return dist.get_world_size(), dist.get_rank()

    assert lg.run_threads(1, rank, backend="host", timeout=30) == [(1, 0)]
    other = SimpleNamespace(rank=1, world=2, ranks_are_threads=False, timeout=30.0)
    with pytest.raises(lg.CheckpointError, match="already has a torch.distributed process group as rank 0 of 1"):
        lowgrad.torch.init_process_group(other)


_RANK = textwrap.dedent("""
    import sys
    from types import SimpleNamespace
    sys.path.insert(0, {root!r})
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    import lowgrad.torch
    rank, files = int(sys.argv[1]), sys.argv[2]
    comm = SimpleNamespace(rank=rank, world=2, ranks_are_threads=False, timeout=60.0)  # as from_env's
    lowgrad.torch.init_process_group(comm, init_method="file://" + files + "/rendezvous")
    assert (dist.get_world_size(), dist.get_rank(), dist.get_backend()) == (2, rank, "gloo")
    rows = lowgrad.torch.ShardRows(torch.full((2, 3), float(rank)), (4, 3), 2 * rank)
    dcp.save({{"w": rows}}, checkpoint_id=files + "/dcp")
    dist.destroy_process_group()
""")


@pytest.mark.timeout(300)
def test_ranks_as_processes_get_their_group_and_dcp_writes_each_ranks_rows(tmp_path: Path) -> None:
    script = _RANK.format(root=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
             for r in range(2)]
    outs = [p.communicate(timeout=240)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    import torch.distributed.checkpoint as dcp
    whole = {"w": torch.zeros(4, 3)}
    with pytest.warns(UserWarning, match="single process"):  # the whole tensor, read from both ranks' chunks
        dcp.load(whole, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert torch.equal(whole["w"], torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2))
