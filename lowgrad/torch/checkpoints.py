"""lowgrad's own checkpoint format for a :class:`lowgrad.torch.ShardOptimizer`:
:func:`save_checkpoint` and :func:`load_checkpoint` (the state dict's tensors as
:class:`lowgrad.checkpoint.Rows`, written and read by :mod:`lowgrad.checkpoint`, at any world)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import torch

from lowgrad import checkpoint
from lowgrad.base.errors import CheckpointError
from lowgrad.diagnostics.log import StepLog
from lowgrad.torch.optimizer import ShardOptimizer
from lowgrad.torch.rows import ShardRows, _local


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bf16: its bits, as ml_dtypes' bfloat16
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _from_numpy(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    if like.dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(like.device)
    return torch.from_numpy(a).to(like.device)


def _as_rows(state: dict[str, Any], data: bool = True) -> dict[str, checkpoint.Rows]:
    """The tensors of a :meth:`ShardOptimizer.state_dict` as the framework-free checkpoint's rows
    (``data=False``: templates of the right dtype and shape, nothing copied off the device)."""
    out = {}
    for key, v in state.items():
        if isinstance(v, torch.Tensor):
            t = _local(v)
            a = _to_numpy(t) if data else np.empty(tuple(t.shape), _to_numpy(t.new_empty(0)).dtype)
            out[key] = checkpoint.Rows(a, tuple(v.size()), v.start if isinstance(v, ShardRows) else 0)
    return out


def save_checkpoint(path: str | os.PathLike[str], optimizer: ShardOptimizer, log: StepLog | None = None) -> Path:
    """Save everything lowgrad holds for the run (:meth:`ShardOptimizer.state_dict` of every
    rank: master weights, optimizer state, manager state) in lowgrad's own format
    (:func:`lowgrad.checkpoint.save`): a directory that appears whole or not at all, every chunk
    checksummed, loadable at any world by :func:`load_checkpoint`. ``log``: a gradient log whose
    running state (:meth:`StepLog.state_dict`) is saved too. A collective, between steps;
    ``path`` must not exist. CheckpointError on every rank when any rank fails (a save before
    ``step()`` applied the last step included), and nothing is written. The model's buffers and
    anything else of the run are the caller's to save (``torch.save(model.state_dict(), ...)``
    from one rank)."""
    def prepare() -> tuple[dict[str, checkpoint.Rows], dict[str, Any]]:
        optimizer._check_between_steps("save_checkpoint")
        optimizer._follow_module()  # weights loaded into the model since the optimizer last wrote it are saved
        state = optimizer._state(copy=False)  # _as_rows copies the live tensors to the host
        return _as_rows(state), {"optimizer": state["optimizer"], **({"log": log.state_dict()} if log else {})}
    # every rank's verdict before the save's own collectives: a rank that cannot save stops all
    rows, meta = checkpoint.agree(optimizer.attached.gm.comm, prepare, f"save {path}")
    return checkpoint.save(path, optimizer.attached.gm, rows, meta)


def load_checkpoint(path: str | os.PathLike[str], optimizer: ShardOptimizer, log: StepLog | None = None) -> None:
    """Load a :func:`save_checkpoint` saved at any world into ``optimizer`` (and its manager, and
    the module's trainable parameters, which get the master weights): this rank's rows read from
    whichever ranks' files hold them, every byte checked first; ``log``: a gradient log given the
    saved running state (:meth:`StepLog.load_state_dict`; a checkpoint saved without one is
    refused). CheckpointError on every rank (naming the rank, the file and what is wrong) for a
    missing, half-written, truncated, corrupted or foreign checkpoint, or a load before ``step()``
    applied the last step, with nothing changed (the log included). A collective, between steps."""
    def saved_state() -> tuple[dict[str, Any], Any, Any]:
        optimizer._check_between_steps("load_checkpoint")
        live = optimizer._state(copy=False)
        # the optimizer first (its class, master_weights): a clearer refusal than the arrays' dtypes
        meta = checkpoint.read_manifest(path)["meta"]
        try:
            optimizer._check_optimizer(meta.get("optimizer"))
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        if log is not None:
            if "log" not in meta:
                raise CheckpointError(f"{path}: holds no gradient log state (saved without log=)")
            try:
                log.check_state(meta["log"])
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"{path}: the gradient log's state: {e}") from None
        return live, meta.get("optimizer"), meta.get("log")
    # every rank's verdict: a manifest one rank cannot read is refused on all (none waits in a collective)
    live, saved, saved_log = checkpoint.agree(optimizer.attached.gm.comm, saved_state, f"load {path}")
    found = checkpoint.read(path, optimizer.attached.gm, _as_rows(live, data=False))
    state: dict[str, Any] = {}
    for key, v in live.items():
        if isinstance(v, torch.Tensor):
            t = _from_numpy(found.arrays[key], _local(v))
            v = ShardRows(t, v.global_shape, v.start) if isinstance(v, ShardRows) else t
        state[key] = v
    state["manager"], state["optimizer"] = found.manager.portable(), saved
    optimizer.load_state_dict(state)
    if log is not None:
        log.load_state_dict(saved_log)  # checked above on every rank: cannot fail now
