"""The layout of an ``nn.Module``: its transformer blocks (:func:`find_blocks`) and the
:class:`lowgrad.Layout` of their trainable parameters, with the module's own parameters in
layout order (:func:`module_layout`); every misuse of a block (differing blocks, a parameter
shared between blocks or with the rest) refused here, before a manager exists."""
from __future__ import annotations

from typing import Any

import torch

from lowgrad.managers.layout import Layout, ParamSpec

_BLOCK_PATHS = ("model.layers", "layers", "transformer.h", "model.decoder.layers")


def find_blocks(model: torch.nn.Module, blocks: str | None = None) -> tuple[str, torch.nn.ModuleList]:
    """The transformer blocks of ``model``: the ``nn.ModuleList`` at the dotted path ``blocks``
    or, when None, at the first of ``model.layers``, ``layers``, ``transformer.h`` and
    ``model.decoder.layers`` that exists; ValueError naming the paths tried otherwise."""
    for path in (blocks,) if blocks is not None else _BLOCK_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.ModuleList) and len(obj):
            return path, obj
        if blocks is not None:
            raise ValueError(f"attach: {blocks!r} is not a non-empty nn.ModuleList of {type(model).__name__}")
    raise ValueError(f"attach: no transformer blocks found in {type(model).__name__} "
                     f"(tried {', '.join(_BLOCK_PATHS)}); pass blocks='dotted.path.to.the.ModuleList'")


def module_layout(model: torch.nn.Module, blocks: str | None = None
                  ) -> tuple[Layout, list[list[tuple[str, torch.nn.Parameter]]], list[tuple[str, torch.nn.Parameter]]]:
    """``(layout, block_params, non_block_params)`` of ``model``: ``block_params[l]`` the
    ``(name, parameter)`` pairs of block ``l`` in layout order, ``non_block_params`` the others.
    Only parameters with ``requires_grad`` count."""
    path, layers = find_blocks(model, blocks)
    per_block = [[(n, p) for n, p in blk.named_parameters() if p.requires_grad] for blk in layers]
    first = [(n, tuple(p.shape), p.dtype) for n, p in per_block[0]]
    if not first:
        raise ValueError(f"attach: the blocks at {path!r} have no trainable parameters")
    for layer, params in enumerate(per_block[1:], 1):
        got = [(n, tuple(p.shape), p.dtype) for n, p in params]
        if got != first:
            raise ValueError(f"attach: block {layer} of {path!r} differs from block 0 (names, shapes, dtypes): "
                             f"{sorted(set(got) ^ set(first))[:4]}")
    owner: dict[int, str] = {}
    for layer, params in enumerate(per_block):
        for n, p in params:
            where = f"{path}.{layer}.{n}"
            if id(p) in owner:
                raise ValueError(f"attach: parameter {where} is shared with {owner[id(p)]}: a block's gradients "
                                 "must be its own (untie them, or leave them out of the blocks)")
            owner[id(p)] = where
    in_blocks = set(owner)
    non_block = []
    for n, p in model.named_parameters():  # deduplicated: a tied parameter appears once
        if p.requires_grad and id(p) not in in_blocks:
            non_block.append((n, p))
    shared = [n for n, p in model.named_parameters(remove_duplicate=False)
              if id(p) in in_blocks and not n.startswith(path + ".")]
    if shared:
        raise ValueError(f"attach: parameter(s) {shared[:4]} outside the blocks are also block parameters")
    layout = Layout(block=tuple(ParamSpec(n, s) for n, s, _ in first),
                    non_block=tuple(ParamSpec(n, tuple(p.shape)) for n, p in non_block), num_layers=len(layers))
    return layout, per_block, non_block
