"""The optimizer: :class:`ShardOptimizer`, a PyTorch optimizer over this rank's gradient
shards (ZeRO-2) that writes the updated rows back into the module and all-gathers them, with
its state dict (manager, master weights, optimizer state: every entry checked before a load
changes anything)."""
from __future__ import annotations

import json
import math
from functools import partial
from typing import Any

import torch

from lowgrad import checkpoint
from lowgrad.base.errors import CheckpointError, NonFiniteGradientError, ProtocolError
from lowgrad.managers.state import ManagerState, resume_state
from lowgrad.torch.attached import Attached, _positive_finite
from lowgrad.torch.rows import ShardRows


def _json_scalar(v: Any) -> Any:
    """A param group's hyper-parameter that JSON cannot hold as is: a one-element tensor (lr)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    raise TypeError(f"a param group value of type {type(v).__name__} cannot be saved in a checkpoint")

def _group_value(where: str, live: Any, saved: Any) -> Any:
    """A param group's saved value (as JSON holds it) checked against this optimizer's ``live``
    one and made its kind: a number stays a number, a flag (bool or None: ``foreach``) a flag,
    a string a string, a one-element tensor a tensor of its shape, dtype and device, a tuple a
    tuple of as many; CheckpointError naming the key otherwise (before anything changes). A NaN
    or infinite number where this optimizer's is finite is refused too (JSON holds them)."""
    def number(v: Any, like: float) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and (math.isfinite(v) or not math.isfinite(like))
    if isinstance(live, torch.Tensor):
        if live.numel() == 1 and number(saved, live.item()):
            return torch.full_like(live, saved)
    elif live is None or isinstance(live, bool):
        if saved is None or isinstance(saved, bool):
            return saved
    elif isinstance(live, (int, float)):
        if number(saved, live):
            return saved
    elif isinstance(live, str):
        if isinstance(saved, str):
            return saved
    elif isinstance(live, (tuple, list)):
        if isinstance(saved, list) and len(saved) == len(live):  # JSON made the tuple a list
            return type(live)(_group_value(f"{where}[{i}]", a, b) for i, (a, b) in enumerate(zip(live, saved)))
    raise CheckpointError(f"{where} is {saved!r}, which is not a value of this optimizer's kind "
                          f"({type(live).__name__} {live!r})")


NONFINITE_POLICIES = ("skip", "raise")


def _buckets(sizes: list[int], capacity: int) -> list[list[tuple[int, int]]]:
    """``(index, offset)`` of each size, packed in order into buckets of ``capacity`` elements
    (each size fits one: ``capacity`` is at least the largest)."""
    buckets: list[list[tuple[int, int]]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if used + n > capacity and buckets[-1]:
            buckets.append([])
            used = 0
        buckets[-1].append((i, used))
        used += n
    return buckets


class ShardOptimizer:
    """A PyTorch optimizer over this rank's gradient shards (ZeRO-2): after each completed step,
    :meth:`step` hands the shards to ``optimizer_cls`` as the gradients of this rank's slices of
    the parameters (rows ``[rank * d0 / world, (rank + 1) * d0 / world)`` of each; a 0-d
    parameter, which trains at world 1 only, whole), updates them, writes them back into the
    module and, at world > 1, all-gathers every updated parameter so each rank's module holds
    the whole model again. Runs on PyTorch's current stream.

    ``master_weights=True`` keeps float32 copies of the slices (the optimizer updates those;
    the module gets them rounded to nearest); False updates the module's bf16 rows in place.
    ``nonfinite`` says what a step whose global gradient norm is not finite does (a loss spike,
    or a step discarded after a fault on any rank): ``"skip"`` (the default, as
    ``torch.amp.GradScaler``) changes nothing and counts it in :attr:`skipped_steps`;
    ``"raise"`` changes nothing and raises :class:`lowgrad.NonFiniteGradientError`.
    ``optimizer_kwargs`` go to ``optimizer_cls`` (e.g. ``lr``, ``weight_decay``, ``foreach``).
    :meth:`state_dict` / :meth:`load_state_dict` checkpoint it with the manager (docs/torch.md)."""

    def __init__(self, attached: Attached, optimizer_cls: Any = None, master_weights: bool = True,
                 nonfinite: str = "skip", **optimizer_kwargs: Any) -> None:
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self.attached, self.nonfinite = attached, nonfinite
        comm = attached.gm.comm
        self.rank, self.world = comm.rank, comm.world
        # the module's parameters in the order of the shards step() reads: blocks, then non-block
        self._module_params = ([p for ps in attached.block_params for _, p in ps]
                               + [p for _, p in attached.non_block_params])
        self._module_rows = [self._rows(p) for p in self._module_params]
        self.master_weights = master_weights
        self.params: list[torch.Tensor] = [
            torch.nn.Parameter(rows.detach().float().clone() if master_weights else rows.detach())
            for rows in self._module_rows]
        self.optimizer = (optimizer_cls or torch.optim.AdamW)(self.params, **optimizer_kwargs)
        #: steps skipped (or raised) for a non-finite gradient norm
        self.skipped_steps = 0
        #: the global gradient norm of the last step (finite or not)
        self.last_norm = math.nan
        self._stepped: int | None = None  # the manager's step count when step() last ran
        self._first_step = attached.gm.step  # before any step(): no completed step is waiting
        full = {id(p): n for n, p in attached.model.named_parameters()}
        #: the module's name of each parameter, in the order of :attr:`params` (the checkpoint's keys)
        self.names = [full[id(p)] for p in self._module_params]
        self._versions = self._module_versions()  # see _follow_module
        self._fresh: list[dict[str, tuple[torch.Size, torch.dtype, torch.device]]] | None = None  # _fresh_state
        # the all-gather after each step: parameters packed in order into buckets of the biggest
        # parameter's size, each bucket one grouped NCCL launch (not one launch per parameter)
        biggest = max(p.numel() for p in self._module_params)
        self._buckets = _buckets([p.numel() for p in self._module_params], biggest)
        self._gather = attached.device.alloc((biggest,), attached.gm.dtype, name="lowgrad_torch_gather") \
            if self.world > 1 else None
        self._gather_event = attached.device.event(name="lowgrad_torch_gather") if self.world > 1 else None

    def _rows(self, p: torch.Tensor) -> torch.Tensor:
        if not p.dim():  # 0-d: the whole parameter (world 1: the layout refuses it at world > 1)
            return p.detach()
        per = p.shape[0] // self.world
        return p.detach()[self.rank * per:(self.rank + 1) * per]

    def step(self, max_norm: float | None = None, eps: float = 1e-6) -> bool:
        """One optimizer step from the completed step's shards; True when it was applied, False
        when it was skipped for a non-finite global gradient norm (then nothing changed:
        parameters, master weights and optimizer state are as before; with ``nonfinite="raise"``
        it raises instead); ProtocolError, with nothing changed, when no step has completed since
        the last call. With ``max_norm`` the gradients are first scaled by ``min(1,
        max_norm / (norm + eps))``, computed in float64 as :meth:`Attached.clip_coefficient`.
        ``max_norm`` and ``eps`` must be finite numbers > 0 (TypeError for a bool or a non-number,
        ValueError otherwise), checked before anything is read or counted: a corrected call
        afterwards applies the step.

        Reads the norm on the host: one sync per step, as ``GradScaler`` makes (the host waits
        for backward to finish; every rank gets the same norm from the same all-reduce, so every
        rank takes the same branch)."""
        if max_norm is not None:  # every argument checked before anything is read or counted
            max_norm = _positive_finite("max_norm", max_norm)
        eps = _positive_finite("eps", eps)
        att = self.attached
        if att.gm.step == self._stepped:  # the shards still hold the step already applied (or skipped)
            raise ProtocolError(f"ShardOptimizer.step: no step has completed since the last call (the manager is "
                                f"at step {att.gm.step}): its gradients would be applied twice")
        self._follow_module()
        norm = math.sqrt(float(att.grad_norm_squared()))  # float64 from the float32 sum of squares
        coef = 1.0 if max_norm is None or not math.isfinite(norm) else min(1.0, max_norm / (norm + eps))
        self.last_norm, self._stepped = norm, att.gm.step
        if not math.isfinite(norm):
            self.skipped_steps += 1
            if self.nonfinite == "raise":
                raise NonFiniteGradientError(f"step {att.gm.step - 1}: the global gradient norm is {norm} on rank "
                                             f"{self.rank}; nothing was updated")
            return False
        shards: list[torch.Tensor] = []
        for layer in range(att.layout.num_layers):
            shards.extend(att.block_shards(layer).values())
        shards.extend(att.non_block_shard(n) for n, _ in att.non_block_params)
        dtype = torch.float32 if self.master_weights else shards[0].dtype
        grads = [s.to(dtype, copy=True) for s in shards]  # the optimizer may change its gradients
        if coef < 1.0:
            torch._foreach_mul_(grads, torch.tensor(coef, dtype=torch.float32, device=grads[0].device))
        for param, grad in zip(self.params, grads):
            param.grad = grad
        self.optimizer.step()
        for param in self.params:
            param.grad = None
        self._publish()
        return True

    def _publish(self) -> None:
        """The module gets the master weights (rounded to nearest) and, at world > 1, every
        rank's rows (all-gathered); the module's versions are recorded after these writes."""
        with torch.no_grad():
            if self.master_weights:
                torch._foreach_copy_(self._module_rows, self.params)
            if self._gather is not None:
                for bucket in self._buckets:
                    self._all_gather([(self._module_params[i], offset) for i, offset in bucket])
        self._versions = self._module_versions()

    def _module_versions(self) -> list[int]:
        return [p._version for p in self._module_params]

    def _follow_module(self) -> None:
        """Master weights follow the module where it was written since the optimizer last wrote it
        (``model.load_state_dict`` after the optimizer was built, an in-place init): a parameter
        whose version moved and whose rows differ from the rounded master weights gets its master
        rows from the module. Rows equal to the rounded master (the same checkpoint loaded again)
        keep the master's float32 bits. Writes that bypass the version counter (``p.data.copy_``)
        are not seen: see docs/torch.md."""
        if not self.master_weights:  # the optimizer updates the module's own rows: nothing to follow
            return
        versions = self._module_versions()
        if versions == self._versions:
            return
        with torch.no_grad():
            for i, (was, now) in enumerate(zip(self._versions, versions)):
                rows, master = self._module_rows[i], self.params[i]
                if was != now and not torch.equal(rows, master.to(rows.dtype)):
                    master.copy_(rows)
        self._versions = versions

    # ---- checkpoint ---------------------------------------------------------------------
    def _row_start(self, p: torch.Tensor) -> int:
        return self.rank * (p.shape[0] // self.world)

    def _pending(self) -> bool:
        """Whether a completed step's gradients wait for :meth:`step` (they are in no checkpoint)."""
        return self.attached.gm.step != (self._first_step if self._stepped is None else self._stepped)

    def _fresh_state(self) -> list[dict[str, tuple[torch.Size, torch.dtype, torch.device]]]:
        """Shape, dtype and device of each state tensor the optimizer's first step creates, per
        parameter (the template of a state dict before that step). Found by the optimizer's own
        lazy init: one step with zero gradients at lr 0 (as torch.distributed.checkpoint.state_dict
        does), after which everything it touched is put back (the parameters' bits, the lr objects)
        and the state it made is removed, so the optimizer is as if it never ran: its real first
        step initializes its state as its class does (NAdam's ``mu_product`` 1, Rprop's
        ``step_size`` lr, SGD's first momentum without dampening), not from a template."""
        if self._fresh is not None:
            return self._fresh
        saved = [p.detach().clone() for p in self.params]
        lrs = [g.get("lr") for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        for p in self.params:
            p.grad = torch.zeros_like(p)
        try:
            self.optimizer.step()
            self._fresh = [{k: (v.shape, v.dtype, v.device) for k, v in self.optimizer.state[p].items()
                            if isinstance(v, torch.Tensor)} for p in self.params]
        finally:
            for g, lr in zip(self.optimizer.param_groups, lrs):
                if lr is not None:
                    g["lr"] = lr
            with torch.no_grad():
                for p, was in zip(self.params, saved):
                    p.grad = None
                    p.copy_(was)
                    self.optimizer.state.pop(p, None)
        return self._fresh

    def _has_state(self) -> bool:
        """Whether the optimizer holds state (each step updates every parameter: all or none;
        some classes, Adagrad, make theirs at construction)."""
        return all(p in self.optimizer.state for p in self.params)

    def state_dict(self) -> dict[str, Any]:
        """Everything lowgrad holds for this rank, between steps (after :meth:`step`): the
        manager's state (``"manager"``: strategy, rounding, base seed, step), the optimizer's
        (``"optimizer"``: class, ``master_weights``, ``skipped_steps``, ``has_state``, its param
        groups' hyper-parameters as JSON), and tensors: ``"master.<parameter name>"`` (this rank's
        rows of the master weights, or of the module where ``master_weights=False``) and
        ``"state.<parameter name>.<key>"`` (the optimizer's state: ``exp_avg``, ``exp_avg_sq``,
        ``step`` for AdamW). Row-sharded tensors are :class:`ShardRows` (this rank's rows and where
        they sit in the whole parameter), which ``torch.distributed.checkpoint`` saves and reshards
        like DTensor shards; the others are the same on every rank.

        The tensors are copies on the CPU, never the live ones: ``dcp.load`` fills them and
        :meth:`load_state_dict` checks them before it copies them in, so a refused load changes
        nothing. Before the optimizer's first step (``has_state`` False) the state tensors are
        zeros of the shapes that step makes (a template to load into; loading such a state leaves
        the optimizer without state, as a fresh one). The master weights first follow module writes
        made since the optimizer last wrote it (as :meth:`step` does: weights loaded into the
        model after the optimizer was built are the ones saved). ProtocolError inside a step, or
        when a completed step waits for :meth:`step`."""
        self._check_between_steps("state_dict")
        self._follow_module()
        return self._state(copy=True)

    def _check_between_steps(self, what: str) -> None:
        if self._pending():
            raise ProtocolError(f"ShardOptimizer.{what}: step {self.attached.gm.step - 1} completed but step() has "
                                "not applied it: call step() first (a checkpoint holds no gradients), or load "
                                "between steps")

    def _state(self, copy: bool) -> dict[str, Any]:
        """The state dict: tensors copied to the CPU (``copy``), else the live master weights and
        state (templates on the state's device where the optimizer has no state yet)."""
        manager = ManagerState.parse(self.attached.gm.state_dict()).portable()
        has_state = self._has_state()
        fresh = None if has_state else self._fresh_state()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        out: dict[str, Any] = {"manager": manager, "optimizer": {
            "class": type(self.optimizer).__qualname__, "master_weights": self.master_weights,
            "skipped_steps": self.skipped_steps, "has_state": has_state,
            "param_groups": json.dumps(groups, default=_json_scalar)}}

        def entry(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            v = v.detach().to("cpu", copy=True) if copy else v.detach()
            # a 0-d parameter is not split in rows: every rank holds it whole
            return ShardRows(v, p.shape, self._row_start(p)) if v.shape == self._rows(p).shape and v.dim() else v

        for i, (name, p, master) in enumerate(zip(self.names, self._module_params, self.params)):
            out[f"master.{name}"] = entry(master, p)
            if fresh is None:
                items = list(self.optimizer.state[master].items())
            else:
                items = [(k, torch.zeros(shape, dtype=dtype, device="cpu" if copy else device))
                         for k, (shape, dtype, device) in fresh[i].items()]
            for key, v in items:
                out[f"state.{name}.{key}"] = entry(v, p) if isinstance(v, torch.Tensor) else v
        return out

    def load_state_dict(self, state: Any) -> None:
        """Restore a :meth:`state_dict` saved at this rank and world (``torch.save``), or one that
        ``dcp.load`` filled in (any world: DCP reshards), or one :func:`load_checkpoint` read.
        Everything is checked first, on every rank, and the verdict agreed (CheckpointError on
        every rank naming the rank and the entry: not a dict, a key missing or unknown, another
        optimizer class, a shape, dtype or row range that is not this rank's, a param-group value
        of another kind than this optimizer's, a manager of another strategy), with nothing
        changed; then the manager's state, the master weights, the optimizer's state and
        hyper-parameters are set, and the module gets the master weights (rounded; every rank's
        rows all-gathered: a collective). Between steps."""
        self._check_between_steps("load_state_dict")
        gm = self.attached.gm
        live = self._state(copy=False)  # the keys, and the live tensors to fill
        # every rank's verdict before anything changes: a state refused on one rank is refused on all
        saved, opt, groups, masters, states = checkpoint.agree(
            gm.comm, partial(self._check_state, state, live), "ShardOptimizer.load_state_dict")
        # checked: from here on nothing fails but the collective
        gm.load_state_dict(saved.as_dict())
        with torch.no_grad():
            for want, got in masters:
                want.copy_(got)
            for master, loaded in zip(self.params, states):
                if not opt["has_state"]:  # saved before its first step: fresh, as the saving run was
                    self.optimizer.state.pop(master, None)
                elif master in self.optimizer.state:
                    for want, got in loaded.values():
                        want.copy_(got)
                else:  # no state here yet: the templates (on the state's device) become it
                    self.optimizer.state[master] = {k: want.copy_(got) for k, (want, got) in loaded.items()}
            for g, new in zip(self.optimizer.param_groups, groups):
                for k, v in new.items():
                    if isinstance(g[k], torch.Tensor):  # a tensor lr stays that tensor (capturable, compiled steps)
                        g[k].copy_(v)
                    else:
                        g[k] = v
        self.skipped_steps, self.last_norm, self._stepped = opt["skipped_steps"], math.nan, gm.step
        self._publish()

    def _check_state(self, state: Any, live: dict[str, Any]) -> tuple[
            ManagerState, dict[str, Any], list[dict[str, Any]], list[tuple[torch.Tensor, torch.Tensor]],
            list[dict[str, tuple[torch.Tensor, torch.Tensor]]]]:
        """``state`` checked against this rank's ``live`` state dict: the manager's state placed here,
        the optimizer entry, the new param groups' values, the (live, loaded) master-weight pairs
        and each parameter's optimizer-state pairs by key."""
        where = "ShardOptimizer.load_state_dict"
        if not isinstance(state, dict):
            raise TypeError(f"{where}: state must be a dict from state_dict(), got {type(state).__name__}")
        gm = self.attached.gm
        missing, unknown = live.keys() - state.keys(), state.keys() - live.keys()
        if missing or unknown:
            raise CheckpointError(f"{where}: keys missing {sorted(missing)[:4]}, unknown "
                                  f"{sorted(unknown)[:4]} (another model or optimizer?)")
        try:
            saved = resume_state(state["manager"], gm)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: 'manager': {e}") from None
        opt, groups = self._check_optimizer(state["optimizer"])
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, want in live.items():
            if key in ("manager", "optimizer"):
                continue
            got = state[key]
            if isinstance(want, ShardRows):
                if not isinstance(got, ShardRows):
                    raise CheckpointError(f"{where}: {key!r} is a {type(got).__name__}, not the ShardRows of "
                                          "state_dict(): which rows it holds is unknown (keep the ShardRows: "
                                          "its clone() is one; load another world's state through dcp.load or "
                                          "load_checkpoint, which reshard)")
                if (got.global_shape, got.start) != (want.global_shape, want.start):
                    raise CheckpointError(f"{where}: {key!r} holds rows from {got.start} of "
                                          f"{tuple(got.global_shape)}; this rank's are from {want.start} of "
                                          f"{tuple(want.global_shape)} (load another world's state through "
                                          "dcp.load or load_checkpoint, which reshard)")
                got, want = got.local, want.local
            if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                what = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
                raise CheckpointError(f"{where}: {key!r} is {what}, this rank's is {want.dtype} {tuple(want.shape)}")
            pairs[key] = (want, got)
        masters = [pairs[f"master.{name}"] for name in self.names]
        has_state = self._has_state()  # the state keys of each parameter, as _state wrote them
        states = [{k: pairs[f"state.{name}.{k}"]
                   for k in (self.optimizer.state[master] if has_state else self._fresh_state()[i])}
                  for i, (name, master) in enumerate(zip(self.names, self.params))]
        return saved, opt, groups, masters, states

    def _check_optimizer(self, opt: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The ``"optimizer"`` entry checked against this optimizer, and the values its param
        groups are to get (each of the kind of this optimizer's: CheckpointError naming it)."""
        where = "ShardOptimizer.load_state_dict: 'optimizer'"
        keys = {"class", "master_weights", "skipped_steps", "has_state", "param_groups"}
        if not isinstance(opt, dict) or set(opt) != keys:
            got = sorted(opt) if isinstance(opt, dict) else type(opt).__name__
            raise CheckpointError(f"{where} is not a ShardOptimizer's ({got}; expected {sorted(keys)})")
        if opt["class"] != type(self.optimizer).__qualname__:
            raise CheckpointError(f"{where}: saved from {opt['class']}, this optimizer is "
                                  f"{type(self.optimizer).__qualname__}")
        if opt["master_weights"] is not self.master_weights:
            raise CheckpointError(f"{where}: saved with master_weights={opt['master_weights']}, this optimizer has "
                                  f"master_weights={self.master_weights}")
        if not isinstance(opt["has_state"], bool):
            raise CheckpointError(f"{where}: has_state {opt['has_state']!r} is not a bool")
        skipped = opt["skipped_steps"]
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
            raise CheckpointError(f"{where}: skipped_steps {skipped!r} is not a non-negative int")
        try:
            groups = json.loads(opt["param_groups"])
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: param_groups is not JSON ({e})") from None
        mine = self.optimizer.param_groups
        if not isinstance(groups, list) or len(groups) != len(mine) or not all(isinstance(g, dict) for g in groups):
            raise CheckpointError(f"{where}: param_groups are not {len(mine)} group(s) of hyper-parameters")
        new = []
        for i, (g, m) in enumerate(zip(groups, mine)):
            extra = set(g) - (set(m) - {"params"})
            if extra:
                raise CheckpointError(f"{where}: param group {i} has {sorted(extra)}, which this "
                                      f"{type(self.optimizer).__qualname__} does not know (another optimizer or "
                                      "torch version?)")
            # a key this optimizer has and the saved group lacks (a newer torch's option) keeps its value
            new.append({k: _group_value(f"{where}: param group {i} {k!r}", m[k], v) for k, v in g.items()})
        return opt, new

    def _all_gather(self, bucket: list[tuple[torch.Tensor, int]]) -> None:
        """Every rank's updated rows of the bucket's parameters into every rank's parameters:
        each packed at its offset of the gather buffer, all gathered in place in one group."""
        att, gather = self.attached, self._gather
        assert gather is not None
        bufs, fulls = [], []
        for p, offset in bucket:
            buf = gather.view(offset, p.numel())
            full = att.view(buf).view(p.shape)
            self._rows(full).copy_(self._rows(p))
            bufs.append(buf)
            fulls.append(full)
        comm, stream = att.gm.comm, att.current_stream()
        with comm.group(stream, event=self._gather_event):
            for buf in bufs:
                comm.all_gather(buf, stream=stream)
        for (p, _), full in zip(bucket, fulls):
            p.detach().copy_(full)

    def close(self) -> None:
        if self._gather is not None:
            self._gather.close()
            self._gather = None
