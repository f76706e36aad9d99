"""Properties of layouts (``lowgrad.managers.layout``): bad ParamSpec, Layout and config fields raise.
"""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from props import BAD, FEW, MEDIUM, bad_dtype_names

import lowgrad
from lowgrad.managers.layout import PRESETS


@MEDIUM
@given(st.data())
def test_paramspec_layout_reject_bad_fields(data) -> None:
    what = data.draw(st.sampled_from(["name", "shape", "dim", "zero_init", "dtype", "block", "non_block",
                                      "num_layers", "duplicate"]))
    good = lowgrad.ParamSpec("w", (4, 2))
    with pytest.raises(BAD):
        if what == "name":
            lowgrad.ParamSpec(data.draw(st.one_of(st.just(""), st.none(), st.integers(), st.binary(max_size=2))),
                              (2,))
        elif what == "shape":
            lowgrad.ParamSpec("w", data.draw(st.one_of(st.none(), st.integers(), st.floats(),
                                                       st.text(max_size=3))))  # () and []: a 0-d shape
        elif what == "dim":
            shape = data.draw(st.lists(st.integers(1, 4), max_size=2))
            bad = data.draw(st.one_of(st.integers(max_value=-1), st.floats(), st.booleans(), st.none(),
                                      st.text(max_size=2)))
            lowgrad.ParamSpec("w", tuple(shape) + (bad,))
        elif what == "zero_init":
            lowgrad.ParamSpec("w", (2,), zero_init=data.draw(st.one_of(st.integers(), st.none(), st.text(max_size=2))))
        elif what == "dtype":
            lowgrad.ParamSpec("w", (2,), dtype=data.draw(st.one_of(bad_dtype_names, st.integers(),
                                                                   st.just(complex))))
        elif what == "block":
            lowgrad.Layout(block=data.draw(st.one_of(st.none(), st.just(good), st.text(max_size=2),
                                                     st.lists(st.integers(), min_size=1, max_size=2))),
                           non_block=[], num_layers=1)
        elif what == "non_block":
            lowgrad.Layout(block=[good], non_block=data.draw(st.one_of(st.integers(), st.just([None]),
                                                                       st.just([good, "x"]))), num_layers=1)
        elif what == "num_layers":
            lowgrad.Layout(block=[good], non_block=[], num_layers=data.draw(st.one_of(
                st.integers(max_value=0), st.floats(), st.booleans(), st.none(), st.text(max_size=2))))
        else:
            lowgrad.Layout(block=[good, lowgrad.ParamSpec("w", (2,))], non_block=[], num_layers=1)


TINY = dict(PRESETS["tiny"])
INT_KEYS = ["hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "num_hidden_layers", "vocab_size"]


@MEDIUM
@given(st.data())
def test_llama_layout_rejects_bad_configs(data) -> None:
    cfg = dict(TINY)
    what = data.draw(st.sampled_from(["int_value", "missing", "flag", "bias", "divisible", "kind"]))
    if what == "int_value":
        cfg[data.draw(st.sampled_from(INT_KEYS + ["head_dim"]))] = data.draw(st.one_of(
            st.integers(max_value=0), st.floats(), st.booleans(), st.text(max_size=2), st.lists(st.integers(),
                                                                                           max_size=1)))
    elif what == "missing":
        del cfg[data.draw(st.sampled_from([k for k in INT_KEYS if k != "num_key_value_heads"]))]
    elif what == "flag":
        cfg[data.draw(st.sampled_from(["tie_word_embeddings", "attention_bias"]))] = data.draw(st.one_of(
            st.integers(), st.none(), st.text(max_size=2), st.floats()))
    elif what == "bias":
        del cfg["model_type"]
        if data.draw(st.booleans()):
            cfg["model_type"] = data.draw(st.one_of(st.text(max_size=5).filter(lambda s: s not in ("qwen2", "llama")),
                                                    st.integers(), st.none(), st.lists(st.integers(), max_size=1)))
    elif what == "divisible":
        cfg["num_key_value_heads"] = 3  # 4 heads not divisible by 3
        if data.draw(st.booleans()):
            cfg["num_key_value_heads"], cfg["hidden_size"] = 2, 66  # 66 % 4 != 0 and no head_dim
    else:
        cfg = data.draw(st.one_of(st.none(), st.integers(), st.floats(), st.binary(max_size=3),
                                  st.text(alphabet="xyz/", min_size=1, max_size=20).map(lambda s: "/nonexist/" + s)))
    with pytest.raises(BAD):
        lowgrad.llama_layout(cfg)


@FEW
@given(st.integers(300, 5000))
def test_llama_layout_long_name_raises_value_error(n) -> None:
    with pytest.raises(BAD):
        lowgrad.llama_layout("x" * n)
