"""Which modules become units."""
from torch import nn

import fsdp_plugin as fp
from fsdp_plugin._build.wrap import owner_unit, select_unit_modules
from models import GPT, Block


def names(model, policy, ignored=()):
    return [n for n, _ in select_unit_modules(model, policy, ignored)]


def test_default_wraps_the_repeated_blocks():
    assert names(GPT(n_layer=3), None) == ["", "blocks.0", "blocks.1", "blocks.2"]


def test_default_uses_hugging_face_no_split_modules():
    model = GPT(n_layer=2)
    model._no_split_modules = ["LayerNorm"]
    assert names(model, None) == ["", "blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f"]


def test_class_set_and_callable():
    model = GPT(n_layer=2)
    assert names(model, {Block}) == ["", "blocks.0", "blocks.1"]
    assert names(model, lambda m: isinstance(m, nn.LayerNorm) and m is not model.ln_f) == [
        "", "blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2"]


def test_size_policy_wraps_bottom_up():
    model = GPT(d=32, n_layer=2)     # a block: fc 4,224 + out 4,128 + attn 3,072 + proj 1,056 + norms 128
    assert names(model, fp.size_policy(10_000)) == ["", "blocks.0", "blocks.1"]
    # fc and out are claimed first; the rest of each block (4,256) still reaches 4,000.
    assert names(model, fp.size_policy(4_000)) == ["", "blocks.0", "blocks.0.fc", "blocks.0.out",
                                                   "blocks.1", "blocks.1.fc", "blocks.1.out"]
    assert names(model, fp.size_policy(4_200)) == ["", "blocks.0", "blocks.0.fc", "blocks.1", "blocks.1.fc"]


def test_ignored_modules_are_not_units():
    model = GPT(n_layer=2)
    assert names(model, {Block}, ignored=[model.blocks[1]]) == ["", "blocks.0"]


def test_tied_parameter_belongs_to_the_outermost_unit():
    units = ["", "a", "a.x", "b"]
    assert owner_unit(["a.x.lin", "a.y"], units) == "a"
    assert owner_unit(["a.x.lin", "b.lin"], units) == ""
    assert owner_unit(["a.x.lin"], units) == "a.x"
