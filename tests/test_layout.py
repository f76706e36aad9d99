"""ParamSpec, Layout and llama_layout: validation, ordering, presets and parameter counts."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

import lowgrad
from lowgrad.managers.layout import PRESETS, Layout, ParamSpec, llama_layout

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 3, "vocab_size": 256}


def cfg(**kw):
    return {**BASE, **kw}


def names(specs):
    return [s.name for s in specs]


# --- ParamSpec ---------------------------------------------------------------------------------

def test_paramspec_basics():
    s = ParamSpec("w", [4, np.int64(3)])
    assert s.shape == (4, 3) and type(s.shape[1]) is int
    assert s.numel == 12 and s.zero_init is False and s.dtype is None
    assert ParamSpec("b", (5,), zero_init=True, dtype="fp32").dtype is lowgrad.fp32
    with pytest.raises(AttributeError):
        s.name = "x"  # frozen


@pytest.mark.parametrize("args, exc", [
    (("", (2,)), ValueError),
    ((3, (2,)), TypeError),
    (("w", (-1,)), ValueError),
    (("w", (2, -3)), ValueError),
    (("w", (2.0,)), TypeError),
    (("w", (True,)), TypeError),
    (("w", 4), TypeError),
    (("w", "4"), TypeError),
])
def test_paramspec_invalid(args, exc):
    with pytest.raises(exc):
        ParamSpec(*args)


def test_zero_d_and_zero_size_paramspecs():
    """A 0-d parameter is one element, its own shard, and trains at world 1 only (one element
    cannot be split); a zero-size one has no elements and shards as any other."""
    gate, empty, wide = ParamSpec("gate", ()), ParamSpec("e", (0, 4)), ParamSpec("w", (4, 0))
    assert (gate.shape, gate.numel, gate.shard_shape(1)) == ((), 1, ())
    assert (empty.numel, empty.shard_shape(2), wide.numel, wide.shard_shape(2)) == (0, (0, 4), 0, (2, 0))
    layout = Layout(block=(gate, empty, wide), non_block=(ParamSpec("t", ()),), num_layers=2)
    assert (layout.block_numel, layout.total_numel) == (1, 3)
    layout.check_world(1)
    with pytest.raises(ValueError, match=r"block parameter 'gate' is 0-d \(one element\).*into 2 equal.*shape \(2,\)"):
        layout.check_world(2)
    Layout(block=(empty, wide), non_block=(), num_layers=1).check_world(4)
    with pytest.raises(ValueError, match="dim 0 .4. is not divisible by world 3"):
        Layout(block=(empty, wide), non_block=(), num_layers=1).check_world(3)


def test_paramspec_invalid_flags():
    with pytest.raises(TypeError):
        ParamSpec("w", (2,), zero_init=1)
    with pytest.raises(TypeError):
        ParamSpec("w", (2,), dtype="int7")


# --- Layout ------------------------------------------------------------------------------------

def test_layout_stores_tuples_and_counts():
    block = [ParamSpec("a", (4, 2)), ParamSpec("b", (4,))]
    lay = Layout(block=block, non_block=[ParamSpec("e", (8, 2))], num_layers=3)
    assert isinstance(lay.block, tuple) and isinstance(lay.non_block, tuple)
    assert lay.num_layers == 3
    assert (lay.block_numel, lay.non_block_numel, lay.total_numel) == (12, 16, 3 * 12 + 16)
    assert lay.block_index("b") == 1 and lay.non_block_index("e") == 0
    with pytest.raises(KeyError):
        lay.block_index("e")
    with pytest.raises(KeyError):
        lay.non_block_index("a")
    # names may repeat across the two lists, only not within one
    Layout(block=[ParamSpec("x", (2,))], non_block=[ParamSpec("x", (2,))], num_layers=1)


@pytest.mark.parametrize("kw, exc", [
    (dict(block=[ParamSpec("a", (2,)), ParamSpec("a", (4,))], non_block=[], num_layers=1), ValueError),
    (dict(block=[], non_block=[ParamSpec("e", (2,)), ParamSpec("e", (2,))], num_layers=1), ValueError),
    (dict(block=[ParamSpec("a", (2,))], non_block=[], num_layers=0), ValueError),
    (dict(block=[ParamSpec("a", (2,))], non_block=[], num_layers=2.0), TypeError),
    (dict(block=[ParamSpec("a", (2,))], non_block=[], num_layers=True), TypeError),
    (dict(block=[("a", (2,))], non_block=[], num_layers=1), TypeError),
    (dict(block=ParamSpec("a", (2,)), non_block=[], num_layers=1), TypeError),
])
def test_layout_invalid(kw, exc):
    with pytest.raises(exc):
        Layout(**kw)


def test_check_world():
    lay = Layout(block=[ParamSpec("a", (8, 3)), ParamSpec("b", (6,))], non_block=[ParamSpec("e", (10, 4))],
                 num_layers=2)
    lay.check_world(1)
    lay.check_world(2)
    with pytest.raises(ValueError) as ei:
        lay.check_world(4)
    msg = str(ei.value)
    assert "'b'" in msg and "(6,)" in msg and "4" in msg
    ok_block = Layout(block=[ParamSpec("a", (8, 3))], non_block=[ParamSpec("e", (10, 4))], num_layers=1)
    with pytest.raises(ValueError) as ei:
        ok_block.check_world(4)
    msg = str(ei.value)
    assert "'e'" in msg and "(10, 4)" in msg and "world 4" in msg
    with pytest.raises(ValueError):
        lay.check_world(0)
    with pytest.raises(TypeError):
        lay.check_world(2.0)


# --- llama_layout ------------------------------------------------------------------------------

def test_block_order_and_shapes_with_bias():
    lay = llama_layout(cfg(attention_bias=True, head_dim=32))
    H, I, q, k = 64, 128, 4 * 32, 2 * 32
    assert [(s.name, s.shape) for s in lay.block] == [
        ("input_layernorm.weight", (H,)),
        ("self_attn.q_proj.weight", (q, H)),
        ("self_attn.k_proj.weight", (k, H)),
        ("self_attn.v_proj.weight", (k, H)),
        ("self_attn.q_proj.bias", (q,)),
        ("self_attn.k_proj.bias", (k,)),
        ("self_attn.v_proj.bias", (k,)),
        ("self_attn.o_proj.weight", (H, q)),
        ("post_attention_layernorm.weight", (H,)),
        ("mlp.gate_proj.weight", (I, H)),
        ("mlp.up_proj.weight", (I, H)),
        ("mlp.down_proj.weight", (H, I)),
    ]
    assert [(s.name, s.shape) for s in lay.non_block] == [
        ("embed_tokens.weight", (256, H)), ("norm.weight", (H,)), ("lm_head.weight", (256, H))]
    assert lay.num_layers == 3


def test_tied_embeddings_drop_lm_head():
    lay = llama_layout(cfg(attention_bias=False, tie_word_embeddings=True))
    assert names(lay.non_block) == ["embed_tokens.weight", "norm.weight"]
    untied = llama_layout(cfg(attention_bias=False))  # default: untied
    assert names(untied.non_block)[-1] == "lm_head.weight"


def test_bias_follows_attention_bias_then_model_type():
    def has_bias(c):
        return "self_attn.q_proj.bias" in names(llama_layout(c).block)

    assert has_bias(cfg(model_type="qwen2"))
    assert not has_bias(cfg(model_type="llama"))
    assert not has_bias(cfg(model_type="qwen2", attention_bias=False))
    assert has_bias(cfg(model_type="llama", attention_bias=True))
    with pytest.raises(ValueError, match="attention_bias"):
        llama_layout(cfg())
    with pytest.raises(ValueError, match="mistral"):
        llama_layout(cfg(model_type="mistral"))


def test_defaults_kv_heads_and_head_dim():
    c = cfg(attention_bias=False)
    del c["num_key_value_heads"]
    lay = llama_layout(c)
    shapes = {s.name: s.shape for s in lay.block}
    assert shapes["self_attn.k_proj.weight"] == (64, 64)  # kv = heads, head_dim = 64 // 4
    lay = llama_layout(cfg(attention_bias=False, num_key_value_heads=None, head_dim=None))
    assert {s.name: s.shape for s in lay.block} == shapes


@pytest.mark.parametrize("bad, exc", [
    (dict(hidden_size=0), ValueError),
    (dict(vocab_size=-1), ValueError),
    (dict(num_hidden_layers=2.5), TypeError),
    (dict(intermediate_size="128"), TypeError),
    (dict(tie_word_embeddings="yes"), TypeError),
    (dict(attention_bias=1), TypeError),
    (dict(num_attention_heads=3), ValueError),  # 64 % 3, no head_dim
    (dict(num_key_value_heads=3, head_dim=16), ValueError),  # 4 heads % 3
])
def test_llama_layout_invalid(bad, exc):
    with pytest.raises(exc):
        llama_layout(cfg(model_type="qwen2", **bad))


def test_llama_layout_missing_key():
    c = cfg(model_type="qwen2")
    del c["vocab_size"]
    with pytest.raises(ValueError, match="vocab_size"):
        llama_layout(c)


# Published parameter counts (the models' safetensors totals).
PUBLISHED = {
    "Qwen2.5-0.5B": 494_032_768,
    "Qwen2.5-1.5B": 1_543_714_304,
    "Qwen2.5-3B": 3_085_938_688,
    "Qwen2.5-7B": 7_615_616_512,
    "Llama-3-8B": 8_030_261_248,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts(name):
    lay = llama_layout(name)
    assert lay.total_numel == PUBLISHED[name]
    assert lay == llama_layout(PRESETS[name])


def test_preset_structure():
    assert "self_attn.q_proj.bias" in names(llama_layout("Qwen2.5-7B").block)
    assert "self_attn.q_proj.bias" not in names(llama_layout("Llama-3-8B").block)
    assert "lm_head.weight" not in names(llama_layout("Qwen2.5-0.5B").non_block)
    assert "lm_head.weight" in names(llama_layout("Qwen2.5-7B").non_block)
    tiny = llama_layout("tiny")
    assert tiny.num_layers == 4 and len(tiny.block) == 12
    for world in (1, 2, 4, 8):
        tiny.check_world(world)


def test_public_names():
    assert lowgrad.llama_layout is llama_layout
    assert lowgrad.Layout is Layout and lowgrad.ParamSpec is ParamSpec


def test_json_path_and_directory(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(PRESETS["Qwen2.5-1.5B"]))
    expected = llama_layout("Qwen2.5-1.5B")
    assert llama_layout(path) == expected
    assert llama_layout(str(path)) == expected
    assert llama_layout(tmp_path) == expected


def test_bad_config_sources(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        llama_layout("Qwen9-1T")
    with pytest.raises(ValueError):
        llama_layout(tmp_path / "missing.json")
    arr = tmp_path / "list.json"
    arr.write_text("[1, 2]")
    with pytest.raises(ValueError):
        llama_layout(arr)
    with pytest.raises(TypeError):
        llama_layout(42)


# --- config.json files: every error names the file ----------------------------------------------
def _write(tmp_path, text: str | bytes):
    path = tmp_path / "config.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", [
    "[" * 100_000 + "]" * 100_000,  # RecursionError in the json module before
    '{"hidden_size": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"hidden_size": 64,',  # truncated
    "",
    b"\xff\xfe{}",  # not UTF-8
    '{"hidden_size": ' + "9" * 5000 + "}",  # beyond Python's int digit limit
])
def test_malformed_config_file_is_a_value_error_naming_it(tmp_path, text):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as info:
        llama_layout(path)
    assert str(path) in str(info.value)
    with pytest.raises(ValueError, match="config.json"):  # the directory form names the file too
        llama_layout(tmp_path)


@pytest.mark.parametrize("key, value, exc", [
    ("hidden_size", "64", TypeError),
    ("hidden_size", 64.0, TypeError),
    ("num_hidden_layers", None, TypeError),
    ("vocab_size", 0, ValueError),
    ("tie_word_embeddings", "false", TypeError),
    ("attention_bias", 0, TypeError),
    ("head_dim", [16], TypeError),
    ("num_key_value_heads", 3, ValueError),
])
def test_wrong_key_in_config_file_names_key_and_file(tmp_path, key, value, exc):
    path = _write(tmp_path, json.dumps(dict(PRESETS["tiny"], **{key: value})))
    with pytest.raises(exc) as info:
        llama_layout(path)
    assert str(path) in str(info.value) and key in str(info.value)


def test_missing_key_and_bad_model_type_name_the_file(tmp_path):
    c = dict(PRESETS["tiny"])
    del c["vocab_size"]
    path = _write(tmp_path, json.dumps(c))
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}.*'vocab_size'"):
        llama_layout(path)
    path = _write(tmp_path, json.dumps(dict(PRESETS["tiny"], model_type=["qwen2"])))
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}.*model_type"):  # unhashable: was a bare TypeError
        llama_layout(path)
