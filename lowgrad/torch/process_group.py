"""The ``torch.distributed`` process group of lowgrad's ranks: what ``torch.distributed.checkpoint``
needs at world > 1 (each rank writes and reads its own rows), which lowgrad's launchers do not
start. :func:`init_process_group` starts it where it can exist (ranks as processes: torchrun and
:func:`lowgrad.from_env`), and refuses ranks that are threads of one process before torch is
called."""
from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from lowgrad.base.errors import CheckpointError
from lowgrad.torch.rows import process_group_ranks


def init_process_group(comm: Any, backend: str = "gloo", **kwargs: Any) -> None:
    """Start ``torch.distributed``'s default process group with ``comm``'s ranks: rank
    ``comm.rank`` of ``comm.world``, by default with ``comm``'s timeout. ``kwargs`` go to
    ``torch.distributed.init_process_group`` (``init_method``, ``store``, ``timeout``); without
    them its ``env://`` rendezvous reads ``MASTER_ADDR`` and ``MASTER_PORT``, as torchrun sets them.
    ``backend``: ``"gloo"`` (DCP's collectives are small host objects) or any other of torch's.
    Where the group already holds these ranks, nothing happens (a second call is harmless).

    :class:`~lowgrad.CheckpointError`, on every rank and before torch is called, where the group
    cannot be: ``comm``'s ranks are threads of this one process (``comm.ranks_are_threads``:
    :func:`lowgrad.run_threads`, the only way the host backend runs world > 1), of which
    ``torch.distributed`` keeps one group per process (two threads that each start one wait for
    each other for ever); or the process already has a group of another rank or world. At world
    1 the group is harmless and DCP needs none."""
    rank, world = comm.rank, comm.world
    if not isinstance(backend, str):
        raise TypeError(f"init_process_group: backend must be a str such as 'gloo', got {backend!r}")
    if world > 1 and comm.ranks_are_threads:
        raise CheckpointError(
            f"lowgrad.torch.init_process_group: rank {rank} of {world} is a thread of this process (lowgrad."
            "run_threads), and torch.distributed has one process group per process: DCP at world > 1 needs its "
            "ranks as processes (torchrun and lowgrad.from_env). With threads, save and resume with "
            "lowgrad.torch.save_checkpoint / load_checkpoint (any world; docs/torch.md)")
    found = process_group_ranks()
    if found is not None:
        if found == (world, rank):
            return
        raise CheckpointError(f"lowgrad.torch.init_process_group: this process already has a torch.distributed "
                              f"process group as rank {found[1]} of {found[0]}, not rank {rank} of {world}")
    if "timeout" not in kwargs and math.isfinite(comm.timeout):
        kwargs["timeout"] = timedelta(seconds=comm.timeout)
    import torch.distributed as dist
    dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)
