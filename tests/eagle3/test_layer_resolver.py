"""The structural decoder-stack resolver (eagle3/capture/layers.py) on plain torch module trees.

Known paths are a fast first try; everything else is found by structure: a ModuleList followed,
on the same owner, by a final norm. These trees are built from class names only (no vLLM, no
weights), so the whole file runs in well under a second.
"""

from __future__ import annotations

import pytest
from torch import nn

from eagle3.capture.layers import LAYER_PATHS, AmbiguousDecoderStack, DecoderStackNotFound, resolve_decoder_stack


def _module(cls: str, **children: nn.Module) -> nn.Module:
    """A module of a class named `cls` with `children` registered in the order given."""
    module = type(cls, (nn.Module,), {})()
    for name, child in children.items():
        setattr(module, name, child)
    return module


def _layers(n: int, *classes: str) -> nn.ModuleList:
    """n layers cycling through `classes` (one class: a plain stack; several: a hybrid)."""
    classes = classes or ("DecoderLayer",)
    return nn.ModuleList(_module(classes[i % len(classes)], proj=nn.Linear(2, 2)) for i in range(n))


def _norm(cls: str = "RMSNorm") -> nn.Module:
    return _module(cls)


def _put(root: nn.Module, path: str, leaf: nn.Module) -> None:
    *owners, name = path.split(".")
    node = root
    for owner in owners:
        if not hasattr(node, owner):
            setattr(node, owner, _module(f"{owner.title()}Module"))
        node = getattr(node, owner)
    setattr(node, name, leaf)


def test_an_unknown_path_with_an_unknown_norm_name_resolves():
    model = _module("TrunkForCausalLM", embed=nn.Embedding(4, 2),
                    trunk=_module("Trunk", blocks=_layers(6), norm_out=nn.LayerNorm(2)), head=nn.Linear(2, 4))
    stack = resolve_decoder_stack(model)
    assert stack.path == "trunk.blocks" and stack.inner is model.trunk and stack.norm is model.trunk.norm_out
    assert stack.num_layers == 6


def test_a_norm_found_by_its_class_name_after_the_list():
    model = _module("Odd", body=_module("Body", pre=nn.LayerNorm(2), stages=_layers(3), closing=_norm("FancyRMSNorm")))
    stack = resolve_decoder_stack(model)
    assert stack.path == "body.stages" and type(stack.norm).__name__ == "FancyRMSNorm"


def test_a_norm_registered_before_the_list_does_not_make_a_stack():
    model = _module("Odd", body=_module("Body", final_norm=nn.LayerNorm(2), stages=_layers(3)))
    with pytest.raises(DecoderStackNotFound, match=r"body\.stages \(3 x DecoderLayer, no final norm\)"):
        resolve_decoder_stack(model)


@pytest.mark.parametrize("path", ["backbone.mixers", "model.layers"])
def test_a_hybrid_stack_is_one_list_of_mixed_layer_classes(path: str):
    """Linear attention / Mamba layers between attention layers: id k is the state entering layer k of THAT list."""
    layers = _layers(8, "LinearAttentionLayer", "LinearAttentionLayer", "LinearAttentionLayer", "FullAttentionLayer")
    model = _module("HybridForCausalLM")
    _put(model, path, layers)
    _put(model, path.rsplit(".", 1)[0] + ".norm_f", _norm())
    stack = resolve_decoder_stack(model)
    assert stack.path == path and stack.layers is layers and stack.num_layers == 8
    assert [type(m).__name__ for m in stack.layers][2:5] == ["LinearAttentionLayer", "FullAttentionLayer", "LinearAttentionLayer"]


def test_lists_inside_the_layers_are_not_stacks():
    """MoE experts (a ModuleList inside each layer), even with a norm after them, are not a second candidate."""
    layers = nn.ModuleList(_module("MoEDecoderLayer", mlp=_module("MoE", experts=_layers(4, "Expert"), post_norm=_norm()))
                           for _ in range(3))
    model = _module("MoEForCausalLM", backbone=_module("MoEModel", blocks=layers, norm=_norm()))
    stack = resolve_decoder_stack(model)
    assert stack.path == "backbone.blocks" and stack.num_layers == 3


def _two_towers(vision: str, text: str, **extra: nn.Module) -> nn.Module:
    model = _module("TwoTowers", **extra)
    _put(model, vision, _layers(4, "VisionBlock"))
    _put(model, vision.rsplit(".", 1)[0] + ".post_norm", nn.LayerNorm(2))
    _put(model, text, _layers(4, "TextDecoderLayer"))
    _put(model, text.rsplit(".", 1)[0] + ".final_norm", _norm())
    return model


def test_two_equal_stacks_resolve_to_the_one_get_language_model_returns():
    model = _two_towers("tower.blocks", "decoder.blocks")
    type(model).get_language_model = lambda self: self.decoder
    stack = resolve_decoder_stack(model)
    assert stack.path == "decoder.blocks" and {type(m).__name__ for m in stack.layers} == {"TextDecoderLayer"}


@pytest.mark.parametrize("text", ["language_model.trunk.blocks", "text_model.blocks"])
def test_two_equal_stacks_resolve_to_the_one_named_as_the_language_model(text: str):
    stack = resolve_decoder_stack(_two_towers("vision_model.blocks", text))
    assert stack.path == text and {type(m).__name__ for m in stack.layers} == {"TextDecoderLayer"}


def test_two_equal_stacks_with_nothing_to_decide_are_refused_naming_both():
    with pytest.raises(AmbiguousDecoderStack) as err:
        resolve_decoder_stack(_two_towers("tower_a.blocks", "tower_b.blocks"))
    message = str(err.value)
    assert "tower_a.blocks (4 x VisionBlock" in message and "tower_b.blocks (4 x TextDecoderLayer" in message
    assert "LAYER_PATHS" in message and "get_language_model()" in message
    assert isinstance(err.value, DecoderStackNotFound)  # callers that catch the general error still do


def test_nothing_fits_names_the_paths_tried_and_the_classes_seen():
    model = _module("Weird", backbone=_module("Backbone", units=_layers(3, "Unit")), head=nn.Linear(2, 2))
    with pytest.raises(DecoderStackNotFound) as err:
        resolve_decoder_stack(model)
    message = str(err.value)
    assert not isinstance(err.value, AmbiguousDecoderStack)
    assert "cannot find the decoder layers of Weird" in message and "'backbone': 'Backbone'" in message
    assert all(path in message for path in LAYER_PATHS)
    assert "backbone.units (3 x Unit, no final norm)" in message


def test_per_layer_norm_lists_are_not_layers():
    model = _module("M", body=_module("Body", layer_norms=nn.ModuleList(nn.LayerNorm(2) for _ in range(3)), norm=_norm()))
    with pytest.raises(DecoderStackNotFound):
        resolve_decoder_stack(model)


@pytest.mark.parametrize("path", LAYER_PATHS)
def test_each_known_path_still_resolves_to_itself(path: str):
    """With a decoy stack elsewhere in the tree: the known path wins without a structural search."""
    model = _module("KnownForCausalLM", decoy=_module("Decoy", blocks=_layers(2), norm=_norm()))
    layers = _layers(5)
    _put(model, path, layers)
    norm_name = "ln_f" if path == "transformer.h" else "norm"
    owner_path = path.rpartition(".")[0]
    _put(model, f"{owner_path}.{norm_name}" if owner_path else norm_name, _norm())
    stack = resolve_decoder_stack(model)
    assert stack.path == path and stack.layers is layers


def test_get_language_model_known_path_keeps_its_prefix():
    lm = _module("Lm", model=_module("Inner", layers=_layers(5), norm=_norm()))
    model = _module("Wrapper", visual=nn.Linear(2, 2), _lm=lm)
    type(model).get_language_model = lambda self: self._lm
    assert resolve_decoder_stack(model).path == "get_language_model().model.layers"


def test_a_list_in_a_thin_container_takes_the_norm_after_the_container():
    """PLaMo 3: Plamo3Model.layers is a Plamo3Decoder owning only the list; the final norm follows it on Plamo3Model."""
    inner = _module("Plamo3Model", embed_tokens=nn.Embedding(4, 2), layers=_module("Plamo3Decoder", layers=_layers(3)),
                    norm=_norm())
    model = _module("Plamo3ForCausalLM", model=inner)
    stack = resolve_decoder_stack(model)
    assert stack.path == "model.layers.layers" and stack.inner is inner and stack.norm is inner.norm


def test_a_final_norm_name_wins_over_another_norm_after_the_list():
    model = _module("M", body=_module("Body", layers=_layers(2), per_layer_projection_norm=_norm(), norm=_norm("FinalNorm")))
    assert type(resolve_decoder_stack(model).norm).__name__ == "FinalNorm"
