"""The checkpoint rows: :class:`ShardRows`, a rank's rows of a parameter-shaped tensor that
``torch.distributed.checkpoint`` saves and reshards like a DTensor shard (the state dict of
:class:`lowgrad.torch.ShardOptimizer` holds its row-sharded tensors as these)."""
from __future__ import annotations

from typing import Any

import torch


class ShardRows(torch.Tensor):
    """This rank's rows ``[start, start + local.shape[0])`` of a parameter-shaped tensor of
    ``global_shape``, as :meth:`ShardOptimizer.state_dict` returns them: ``size()`` is the global
    shape, and the three methods ``torch.distributed.checkpoint`` asks a DTensor for
    (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``) describe
    and hand over the local rows, so ``dcp.save`` writes each rank's rows as one chunk of the
    whole tensor and ``dcp.load`` fills them from whichever chunks overlap them: resharding at
    any world, with no process group of its own and no DTensor mesh. ``local`` is the tensor
    itself (the live rows); anything else should read it, not this wrapper."""

    local: torch.Tensor
    global_shape: torch.Size
    start: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, global_shape: Any, start: int) -> ShardRows:
        r = torch.Tensor._make_subclass(cls, local.detach())
        r.local, r.global_shape, r.start = local.detach(), torch.Size(global_shape), start
        return r

    # operations on it give plain tensors of the local rows (the wrapper is only for DCP's planner)
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def size(self, dim: int | None = None) -> Any:
        return self.global_shape if dim is None else self.global_shape[dim]

    # torch's own printing would index the local rows by the global size()
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (f"ShardRows(rows [{self.start}, {self.start + self.local.shape[0]}) of {tuple(self.global_shape)}, "
                f"{self.local!r})")

    def clone(self, *args: Any, **kwargs: Any) -> ShardRows:
        """A copy that still says where its rows belong (a plain tensor would not: a load refuses it)."""
        return ShardRows(self.local.clone(*args, **kwargs), self.global_shape, self.start)

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardRows:  # copy.deepcopy(state_dict) keeps it one too
        memo[id(self)] = out = self.clone()
        return out

    def _process_group_problem(self) -> str | None:
        """Why DCP cannot write or read these rows as their own chunk here, or None
        (:func:`process_group_problem`). The rows are one of ``parts`` equal parts of the
        parameter (how ShardOptimizer splits it), so the group must have that world and this
        part's rank; the whole parameter needs none."""
        rows = self.local.shape[0] if self.local.dim() else 0
        return process_group_problem(self.global_shape[0] // rows, self.start // rows) if rows else None

    def _check_process_group(self) -> None:
        problem = self._process_group_problem()
        if problem is not None:
            # a RuntimeError, not CheckpointError (also a ValueError): DCP's load turns a ValueError
            # from a chunk list into "Invalid checkpoint metadata", hiding the reason
            raise RuntimeError(problem)

    def _chunk(self) -> Any:
        self._check_process_group()
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        offsets = torch.Size([self.start] + [0] * (len(self.global_shape) - 1))
        return ChunkStorageMetadata(offsets=offsets, sizes=self.local.size())

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        chunk = self._chunk()
        return [WriteItem(index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=chunk, size=self.global_shape,
                                                      properties=TensorProperties.create_from_tensor(self.local)))]

    def __create_chunk_list__(self) -> list[Any]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self.local

    def __reduce_ex__(self, protocol: Any) -> Any:  # torch.save keeps what it is: the rows and their place
        return ShardRows, (self.local, tuple(self.global_shape), self.start)


# its pickled name stays the public one (``lowgrad.torch.ShardRows``), as before the adapter was a
# package: a state dict torch.save'd then still loads with weights_only=True
ShardRows.__module__ = "lowgrad.torch"

# torch.load's default (weights_only=True) loads a torch.save of a state dict: the class rebuilds
# from a tensor, a tuple of ints and an int, and runs no other code
torch.serialization.add_safe_globals([ShardRows])


def process_group_ranks() -> tuple[int, int] | None:
    """(world, rank) of this process's ``torch.distributed`` default process group, or None."""
    import torch.distributed as dist
    return (dist.get_world_size(), dist.get_rank()) if dist.is_available() and dist.is_initialized() else None


def process_group_problem(world: int, rank: int) -> str | None:
    """Why DCP cannot save or load rank ``rank``'s rows of a run of ``world`` ranks here, or None:
    it needs a ``torch.distributed`` process group of ``world`` ranks with this process as ``rank``
    (none at world 1). Without one, DCP makes every rank "rank 0" of a world of 1, which writes the
    same file and ``.metadata`` (the last writer wins: a checkpoint of one rank's rows, and a load
    that fills every rank's rows from it without a word)."""
    if world == 1:
        return None
    found = process_group_ranks()
    if found == (world, rank):
        return None
    return (f"torch.distributed.checkpoint of a rank's rows (rank {rank} of {world}) needs a torch.distributed "
            f"process group of the run's ranks; found {'none' if found is None else f'rank {found[1]} of {found[0]}'}"
            ". lowgrad's launchers start none: where the ranks are processes (torchrun, lowgrad.from_env), call "
            "lowgrad.torch.init_process_group(comm) first; ranks that are threads of one process (run_threads, "
            "the host backend) cannot have one: use lowgrad.torch.save_checkpoint / load_checkpoint (docs/torch.md)")


def _local(t: Any) -> Any:
    """The rows a state-dict value holds (a :class:`ShardRows`' local tensor, else the value)."""
    return t.local if isinstance(t, ShardRows) else t
