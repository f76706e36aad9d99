"""``torch.distributed.checkpoint`` (DCP) of lowgrad's state with lowgrad's error kind:
:func:`dcp_save` and :func:`dcp_load` are ``dcp.save`` and ``dcp.load`` that check first, agreed on
every rank, that DCP can write or read each :class:`ShardOptimizer`'s rows (a process group of the
run's ranks), and raise :class:`~lowgrad.CheckpointError` for any failure. DCP itself reports a
failure inside its planning as PyTorch's ``CheckpointException``, which derives from
``BaseException``: an ``except Exception`` around a save would not catch it (nor the process group
refusal raised there)."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from lowgrad import checkpoint
from lowgrad.base.errors import CheckpointError
from lowgrad.torch.optimizer import ShardOptimizer
from lowgrad.torch.rows import ShardRows, process_group_problem


def dcp_save(state_dict: Mapping[str, Any], checkpoint_id: str | os.PathLike[str], **kwargs: Any) -> Any:
    """``torch.distributed.checkpoint.save(state_dict, checkpoint_id=..., **kwargs)`` (a
    :class:`ShardOptimizer` in it saved as the ``Stateful`` it is), with lowgrad's checks first
    (:func:`_check`) and CheckpointError for any failure: nothing is written when a check fails."""
    import torch.distributed.checkpoint as dcp
    return _run(dcp.save, "dcp_save", state_dict, checkpoint_id, kwargs)


def dcp_load(state_dict: Mapping[str, Any], checkpoint_id: str | os.PathLike[str], **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load(state_dict, checkpoint_id=..., **kwargs)``, with
    lowgrad's checks first (:func:`_check`) and CheckpointError for any failure (a
    :class:`ShardOptimizer` checks what DCP read before it changes: a refused load changes
    nothing)."""
    import torch.distributed.checkpoint as dcp
    _run(dcp.load, "dcp_load", state_dict, checkpoint_id, kwargs)


def _run(call: Callable[..., Any], name: str, state_dict: Mapping[str, Any], checkpoint_id: str | os.PathLike[str],
         kwargs: dict[str, Any]) -> Any:
    what = f"{name} {os.fspath(checkpoint_id)}"
    _check(state_dict, what)
    with _as_checkpoint_error(what):
        return call(state_dict, checkpoint_id=checkpoint_id, **kwargs)


def _check(state_dict: Mapping[str, Any], what: str) -> None:
    """Each :class:`ShardOptimizer` in ``state_dict`` checked on every rank of its communicator
    (``checkpoint.agree``: one rank's refusal is every rank's CheckpointError, none waits in DCP's
    collectives), each :class:`ShardRows` elsewhere in it (a state dict's copy) on this rank."""
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(f"{what}: the state dict is a {type(state_dict).__name__}, not a mapping")
    for value in state_dict.values():
        if isinstance(value, ShardOptimizer):
            gm = value.attached.gm
            checkpoint.agree(gm.comm, lambda: _refuse(process_group_problem(gm.world, gm.rank)), what)
        else:
            for rows in _rows_in(value):
                _refuse(rows._process_group_problem(), what)


def _refuse(problem: str | None, what: str = "") -> None:
    if problem is not None:
        raise CheckpointError(f"{what}: {problem}" if what else problem)


def _rows_in(value: Any) -> Iterator[ShardRows]:
    if isinstance(value, ShardRows):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _rows_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _rows_in(v)


@contextmanager
def _as_checkpoint_error(what: str) -> Iterator[None]:
    """DCP's ``CheckpointException`` (a BaseException, every rank's failures in it) and any other
    error of DCP's as CheckpointError naming each failed rank and what it raised; lowgrad's own
    errors (a refused load's CheckpointError, already every rank's) as they are."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        yield
    except CheckpointException as e:
        said = "; ".join(f"rank {r}: {type(f[0]).__name__}: {f[0]}" for r, f in sorted(e.failures.items()))
        raise CheckpointError(f"{what}: {said or e}") from e
    except CheckpointError:
        raise
    except Exception as e:  # DCP's own, raised outside its planning: named, with the checkpoint
        raise CheckpointError(f"{what}: {type(e).__name__}: {e}") from e
