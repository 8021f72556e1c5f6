from __future__ import annotations

import pytest
import torch
from torch import nn

from eagle3.capture.layers import DecoderStackNotFound, resolve_decoder_stack
from eagle3.data.target import check_aux_layer_ids, default_aux_layer_ids


class _Inner(nn.Module):
    def __init__(self, n: int, norm_name: str = "norm", layers_name: str = "layers") -> None:
        super().__init__()
        setattr(self, layers_name, nn.ModuleList(nn.Linear(4, 4) for _ in range(n)))
        setattr(self, norm_name, nn.LayerNorm(4))


class _CausalLM(nn.Module):  # Llama/Qwen/DeepseekV3 shape: .model.layers + .model.norm
    def __init__(self, n: int) -> None:
        super().__init__()
        self.model = _Inner(n)


class KimiK25ForConditionalGeneration(nn.Module):  # attribute names as in vLLM's kimi_k25.py
    def __init__(self) -> None:
        super().__init__()
        self.vision_tower = nn.Linear(2, 2)
        self.mm_projector = nn.Linear(2, 2)
        self.language_model = _CausalLM(6)


class _MultiModal(nn.Module):  # vLLM multimodal models expose get_language_model()
    def __init__(self) -> None:
        super().__init__()
        self.visual = nn.Linear(2, 2)
        self._lm = _CausalLM(5)

    def get_language_model(self) -> nn.Module:
        return self._lm


class _GPT2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = _Inner(4, norm_name="ln_f", layers_name="h")


def test_llama_style():
    m = _CausalLM(8)
    stack = resolve_decoder_stack(m)
    assert stack.path == "model.layers" and stack.num_layers == 8 and stack.norm is m.model.norm


def test_kimi_k25_wrapper():
    m = KimiK25ForConditionalGeneration()
    stack = resolve_decoder_stack(m)
    assert stack.path == "language_model.model.layers" and stack.inner is m.language_model.model


def test_get_language_model():
    m = _MultiModal()
    stack = resolve_decoder_stack(m)
    assert stack.path == "get_language_model().model.layers" and stack.num_layers == 5


def test_gpt2_style():
    stack = resolve_decoder_stack(_GPT2())
    assert stack.path == "transformer.h" and isinstance(stack.norm, nn.LayerNorm)


def test_real_hf_llama(tiny_target):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    stack = resolve_decoder_stack(m)
    assert stack.path == "model.layers" and stack.num_layers == m.config.num_hidden_layers


def test_unknown_tree_names_paths_and_classes():
    class Weird(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = _Inner(3)
            del self.backbone.norm  # with its norm, `backbone.layers` is found by structure (test_layer_resolver.py)

    with pytest.raises(DecoderStackNotFound) as err:
        resolve_decoder_stack(Weird())
    message = str(err.value)
    assert "Weird" in message and "model.layers" in message and "transformer.h" in message and "_Inner" in message


def test_layers_without_a_final_norm_are_not_accepted():
    m = _CausalLM(4)
    del m.model.norm
    with pytest.raises(DecoderStackNotFound, match="no final norm"):
        resolve_decoder_stack(m)


def test_aux_ids():
    assert default_aux_layer_ids(30) == [2, 15, 27]
    assert check_aux_layer_ids([2, 4, 5], 8) == [2, 4, 5]
    with pytest.raises(ValueError, match=r"target.aux_layer_ids=\[2, 9\].*out of range"):
        check_aux_layer_ids([2, 9], 8)
    with pytest.raises(ValueError, match="duplicates"):
        check_aux_layer_ids([2, 2, 3], 8)
