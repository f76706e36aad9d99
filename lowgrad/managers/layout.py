"""Model layouts: which gradient tensors a model has, per transformer block and outside blocks.

A :class:`Layout` lists the parameters of one transformer block (repeated ``num_layers`` times)
and the non-block parameters (embeddings, final norm, head). Positions in ``block`` and
``non_block`` are the ``tensor`` indices of the per-use seeds (see :mod:`lowgrad.sr.seeds`).
:func:`llama_layout` builds the layout of a Llama/Qwen2-style model from its Hugging Face
``config.json``.
"""
from __future__ import annotations

import json
import math
import operator
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowgrad.base.dtypes import DType, as_dtype
from lowgrad.base.integers import integer


@dataclass(frozen=True)
class ParamSpec:
    """One parameter's gradient: a name, a shape (tuple of ints >= 0: ``()`` is a 0-d parameter,
    one element, e.g. a per-block gate or a temperature; a 0 anywhere a zero-size one, no
    elements), ``zero_init`` (the
    manager zeroes it and the engine always adds into it) and an optional ``dtype``, the dtype
    the engine's parameter has: a manager keeps one gradient dtype for every tensor, so it refuses
    a layout whose ``dtype`` differs from its own (TypeError at creation) rather than convert."""

    name: str
    shape: tuple[int, ...]
    zero_init: bool = False
    dtype: DType | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"ParamSpec name must be a str, got {type(self.name).__name__}")
        if not self.name:
            raise ValueError("ParamSpec name must not be empty")
        if isinstance(self.shape, (str, bytes)) or not isinstance(self.shape, Iterable):
            raise TypeError(f"ParamSpec {self.name!r}: shape must be a sequence of ints, got {self.shape!r}")
        dims = []
        for d in self.shape:
            if isinstance(d, bool):
                raise TypeError(f"ParamSpec {self.name!r}: shape entries must be ints, got {self.shape!r}")
            try:
                dims.append(operator.index(d))
            except TypeError:
                raise TypeError(f"ParamSpec {self.name!r}: shape entries must be ints, got {self.shape!r}") from None
        if any(d < 0 for d in dims):
            raise ValueError(f"ParamSpec {self.name!r}: shape must be a tuple of ints >= 0, got {tuple(dims)}")
        object.__setattr__(self, "shape", tuple(dims))
        if not isinstance(self.zero_init, bool):
            raise TypeError(f"ParamSpec {self.name!r}: zero_init must be a bool, got {self.zero_init!r}")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", as_dtype(self.dtype))

    @property
    def numel(self) -> int:
        """Number of elements (1 for a 0-d parameter, 0 for a zero-size one)."""
        return math.prod(self.shape)

    def shard_shape(self, world: int) -> tuple[int, ...]:
        """The shape of one of ``world`` shards: dim 0 split into ``world`` equal slices; a 0-d
        parameter is its own shard (world 1 only: :meth:`Layout.check_world`)."""
        return (self.shape[0] // world, *self.shape[1:]) if self.shape else ()


def _specs(kind: str, specs: Iterable[ParamSpec]) -> tuple[ParamSpec, ...]:
    if isinstance(specs, (str, bytes, ParamSpec)) or not isinstance(specs, Iterable):
        raise TypeError(f"Layout {kind} must be a sequence of ParamSpec, got {specs!r}")
    out = tuple(specs)
    seen: set[str] = set()
    for s in out:
        if not isinstance(s, ParamSpec):
            raise TypeError(f"Layout {kind} entries must be ParamSpec, got {s!r}")
        if s.name in seen:
            raise ValueError(f"Layout {kind}: duplicate parameter name {s.name!r}")
        seen.add(s.name)
    return out


@dataclass(frozen=True)
class Layout:
    """``block``: the parameters of one transformer block (the same for each of ``num_layers``
    layers); ``non_block``: the parameters outside the blocks. Both are stored as tuples."""

    block: tuple[ParamSpec, ...]
    non_block: tuple[ParamSpec, ...]
    num_layers: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", _specs("block", self.block))
        object.__setattr__(self, "non_block", _specs("non_block", self.non_block))
        object.__setattr__(self, "num_layers", integer("Layout num_layers", self.num_layers))
        if self.num_layers < 1:
            raise ValueError(f"Layout num_layers must be >= 1, got {self.num_layers}")

    @property
    def block_numel(self) -> int:
        """Elements of one block's parameters."""
        return sum(s.numel for s in self.block)

    @property
    def non_block_numel(self) -> int:
        """Elements of the non-block parameters."""
        return sum(s.numel for s in self.non_block)

    @property
    def total_numel(self) -> int:
        """Elements of the whole model: ``num_layers * block_numel + non_block_numel``."""
        return self.num_layers * self.block_numel + self.non_block_numel

    def block_index(self, name: str) -> int:
        """Position of block parameter ``name`` (its seed ``tensor`` index); KeyError if absent."""
        for i, s in enumerate(self.block):
            if s.name == name:
                return i
        raise KeyError(f"no block parameter named {name!r}")

    def non_block_index(self, name: str) -> int:
        """Position of non-block parameter ``name`` (its seed ``tensor`` index); KeyError if absent."""
        for i, s in enumerate(self.non_block):
            if s.name == name:
                return i
        raise KeyError(f"no non-block parameter named {name!r}")

    def check_world(self, world: int) -> None:
        """Raise ValueError naming the parameter, its shape and ``world`` if any parameter's dim 0
        is not divisible by ``world`` (sharding splits dim 0 into ``world`` equal slices), or if
        a parameter is 0-d and ``world`` > 1 (its one element cannot be split: the reduce-scatter
        and the all-to-all give every rank the same number of elements)."""
        world = integer("world", world)
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        for kind, specs in (("block", self.block), ("non-block", self.non_block)):
            for s in specs:
                if not s.shape and world > 1:
                    raise ValueError(f"{kind} parameter {s.name!r} is 0-d (one element): sharding splits dim 0 "
                                     f"into {world} equal slices, and one element cannot be split; at world > 1 "
                                     f"give it a dim 0 divisible by {world} (e.g. shape ({world},), the same value "
                                     "in each element), or freeze it (requires_grad=False); 0-d parameters train "
                                     "at world 1")
                if s.shape and s.shape[0] % world:
                    raise ValueError(f"{kind} parameter {s.name!r} of shape {s.shape}: dim 0 ({s.shape[0]}) "
                                     f"is not divisible by world {world}")


# Hugging Face config.json values (the keys llama_layout reads).
PRESETS: dict[str, dict[str, Any]] = {
    "Qwen2.5-0.5B": {
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
        "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24,
        "vocab_size": 151936, "tie_word_embeddings": True,
    },
    "Qwen2.5-1.5B": {
        "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
        "num_attention_heads": 12, "num_key_value_heads": 2, "num_hidden_layers": 28,
        "vocab_size": 151936, "tie_word_embeddings": True,
    },
    "Qwen2.5-3B": {
        "model_type": "qwen2", "hidden_size": 2048, "intermediate_size": 11008,
        "num_attention_heads": 16, "num_key_value_heads": 2, "num_hidden_layers": 36,
        "vocab_size": 151936, "tie_word_embeddings": True,
    },
    "Qwen2.5-7B": {
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
        "num_attention_heads": 28, "num_key_value_heads": 4, "num_hidden_layers": 28,
        "vocab_size": 152064, "tie_word_embeddings": False,
    },
    "Llama-3-8B": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
        "vocab_size": 128256, "tie_word_embeddings": False, "attention_bias": False,
    },
    "tiny": {  # for tests and the demo
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
        "vocab_size": 256, "tie_word_embeddings": False,
    },
}

_BIAS_BY_MODEL_TYPE = {"qwen2": True, "llama": False}
_MAX_CONFIG_BYTES = 16 << 20  # a config.json is a few KiB; refuse to read more than this


def _load_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> tuple[Mapping[str, Any], str]:
    """(the config mapping, where it came from for error messages: the file's path, the preset
    or "config")."""
    if isinstance(config, Mapping):
        return config, "config"
    if isinstance(config, str) and config in PRESETS:
        return PRESETS[config], f"preset {config!r}"
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"llama_layout config must be a dict, a preset name or a path, got {config!r}")
    path = Path(config)
    try:
        if path.is_dir():
            path = path / "config.json"
        found = path.is_file()
    except OSError:  # e.g. a name too long to be a path
        found = False
    if not found:
        raise ValueError(f"llama_layout: {str(config)!r} is neither a preset ({', '.join(PRESETS)}) "
                         f"nor an existing config.json file or model directory")
    with open(path, "rb") as f:
        raw = f.read(_MAX_CONFIG_BYTES + 1)
    if len(raw) > _MAX_CONFIG_BYTES:
        raise ValueError(f"llama_layout: {path} is larger than {_MAX_CONFIG_BYTES >> 20} MiB, not a config.json")
    try:
        loaded = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError(f"llama_layout: {path} nests JSON too deeply to be a config.json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int beyond the digit limit
        raise ValueError(f"llama_layout: {path} is not valid JSON: {exc}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"llama_layout: {path} does not hold a JSON object")
    return loaded, str(path)


def _positive_int(cfg: Mapping[str, Any], key: str, src: str) -> int:
    if key not in cfg:
        raise ValueError(f"llama_layout: {src} lacks {key!r}")
    v = cfg[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"llama_layout: {src}: {key!r} must be an int, got {v!r}")
    if v <= 0:
        raise ValueError(f"llama_layout: {src}: {key!r} must be positive, got {v}")
    return v


def _flag(cfg: Mapping[str, Any], key: str, src: str) -> bool:
    v = cfg[key]
    if not isinstance(v, bool):
        raise TypeError(f"llama_layout: {src}: {key!r} must be a bool, got {v!r}")
    return v


def llama_layout(config: Mapping[str, Any] | str | os.PathLike[str]) -> Layout:
    """Layout of a Llama/Qwen2-style decoder with Hugging Face parameter names.

    ``config`` is a ``config.json`` dict, a name in :data:`PRESETS`, or the path of a
    ``config.json`` (or of a directory holding one). Keys: ``hidden_size``,
    ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads`` (default: the head
    count), ``num_hidden_layers``, ``vocab_size``, ``tie_word_embeddings`` (default False; when
    True there is no ``lm_head.weight``), ``head_dim`` (default ``hidden_size //
    num_attention_heads``) and ``attention_bias`` (QKV biases; absent, it follows
    ``model_type``: ``qwen2`` has them, ``llama`` has not). A missing or mistyped key, or a file
    that is not a JSON object, raises ValueError/TypeError naming the key and the file.
    """
    return _layout_from_config(*_load_config(config))


def _layout_from_config(cfg: Mapping[str, Any], src: str = "config") -> Layout:
    """:func:`llama_layout` of a loaded config mapping; ``src`` names it in error messages."""
    hidden = _positive_int(cfg, "hidden_size", src)
    inter = _positive_int(cfg, "intermediate_size", src)
    heads = _positive_int(cfg, "num_attention_heads", src)
    kv = _positive_int(cfg, "num_key_value_heads", src) if cfg.get("num_key_value_heads") is not None else heads
    layers = _positive_int(cfg, "num_hidden_layers", src)
    vocab = _positive_int(cfg, "vocab_size", src)
    tied = _flag(cfg, "tie_word_embeddings", src) if "tie_word_embeddings" in cfg else False
    if cfg.get("head_dim") is not None:
        head_dim = _positive_int(cfg, "head_dim", src)
    elif hidden % heads:
        raise ValueError(f"llama_layout: {src}: hidden_size {hidden} is not divisible by num_attention_heads "
                         f"{heads}; give head_dim")
    else:
        head_dim = hidden // heads
    if heads % kv:
        raise ValueError(f"llama_layout: {src}: num_attention_heads {heads} is not divisible by "
                         f"num_key_value_heads {kv}")
    model_type = cfg.get("model_type")
    if "attention_bias" in cfg:
        bias = _flag(cfg, "attention_bias", src)
    elif isinstance(model_type, str) and model_type in _BIAS_BY_MODEL_TYPE:
        bias = _BIAS_BY_MODEL_TYPE[model_type]
    else:
        raise ValueError(f"llama_layout: {src} has no 'attention_bias' and model_type "
                         f"{model_type!r} is not one of {', '.join(_BIAS_BY_MODEL_TYPE)}")

    q, k = heads * head_dim, kv * head_dim
    block = [
        ParamSpec("input_layernorm.weight", (hidden,)),
        ParamSpec("self_attn.q_proj.weight", (q, hidden)),
        ParamSpec("self_attn.k_proj.weight", (k, hidden)),
        ParamSpec("self_attn.v_proj.weight", (k, hidden)),
    ]
    if bias:
        block += [ParamSpec("self_attn.q_proj.bias", (q,)), ParamSpec("self_attn.k_proj.bias", (k,)),
                  ParamSpec("self_attn.v_proj.bias", (k,))]
    block += [
        ParamSpec("self_attn.o_proj.weight", (hidden, q)),
        ParamSpec("post_attention_layernorm.weight", (hidden,)),
        ParamSpec("mlp.gate_proj.weight", (inter, hidden)),
        ParamSpec("mlp.up_proj.weight", (inter, hidden)),
        ParamSpec("mlp.down_proj.weight", (hidden, inter)),
    ]
    non_block = [ParamSpec("embed_tokens.weight", (vocab, hidden)), ParamSpec("norm.weight", (hidden,))]
    if not tied:
        non_block.append(ParamSpec("lm_head.weight", (vocab, hidden)))
    return Layout(block=tuple(block), non_block=tuple(non_block), num_layers=layers)
