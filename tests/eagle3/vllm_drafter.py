"""What vLLM's own EAGLE-3 draft computes while it serves: its first two forward calls on one prompt.

Shared by the tests that hold our draft module against vLLM's (test_mla_draft, test_eagle_3_1, test_draft_layers).
"""

from __future__ import annotations

import torch

from tests.on_device import (
    DTYPE,
    KV_CACHE_GIB,
    assert_close,
    eager_serving,
    v1_model_runner,
)


def first_two_draft_forwards(llm, prompt: list[int]) -> tuple[torch.nn.Module, dict, dict]:  # noqa: ANN001 - vllm.LLM
    """Greedy-generate 2 tokens from `prompt` on an in-process engine that serves a draft (loaded under
    tests.on_device.v1_model_runner), shut the engine down, and
    return (vLLM's draft module, its first forward, its second): the first reads the whole prompt, the second the
    one token the first drafted. Each call: input_ids, positions, hidden_states (what the forward read), aux (the
    target's aux states before any norm, [T, n_aux*H]), fc_input (what fc read), logits (over the target vocabulary)
    and handed_on (the hidden the forward hands the next step), each on the CPU."""
    from eagle3.capture import vllm_adapter, vllm_serving

    try:
        model = llm.collective_rpc(lambda worker: worker.model_runner)[0].drafter.model
        calls: list[dict] = []
        aux: list[torch.Tensor] = []
        fc_inputs: list[torch.Tensor] = []

        def copy(t: torch.Tensor) -> torch.Tensor:  # a copy on the CPU: vLLM reuses its input buffers step after step
            return t.detach().to("cpu", copy=True)

        combine = model.combine_hidden_states
        model.combine_hidden_states = lambda states: (aux.append(states.detach().clone()), combine(states))[1]
        model.model.fc.register_forward_hook(lambda m, args, out: fc_inputs.append(args[0].detach().clone()))

        def record(module, args, kwargs, out):  # noqa: ANN001, ANN202
            calls.append({"input_ids": copy(kwargs["input_ids"]), "positions": copy(kwargs["positions"]),
                          "hidden_states": copy(kwargs["hidden_states"]), "aux": copy(aux[-1]) if aux else None,
                          "fc_input": copy(fc_inputs[-1]) if fc_inputs else None,
                          "logits": copy(module.compute_logits(out[0])), "handed_on": copy(out[1])})

        model.register_forward_hook(record, with_kwargs=True)
        vllm_serving.greedy_generate(llm, [prompt], max_new_tokens=2)
    finally:
        vllm_adapter.shutdown_engine(llm)
    first, second = calls[0], calls[1]
    assert first["input_ids"].shape[0] == len(prompt) and second["input_ids"].shape[0] == 1
    return model, first, second


def assert_vllm_computes_our_llama_draft(export) -> torch.nn.Module:  # noqa: ANN001 - a Path
    """Serve the tiny target with the Llama-style draft exported in `export` (2 speculative tokens, in this device's
    dtype: tests/on_device.py) and check that vLLM's first draft forward (the whole 13-token prompt) and its second
    (one row: the token the first drafted) give our module's fused hidden, handed-on hidden and logits (float32:
    within 1e-5, 1e-5 and 1e-4; else the dtype's tolerance), our module unrolled as in training with one TTT cache
    per layer. Returns vLLM's draft module for setting-specific checks."""
    from eagle3.capture import vllm_adapter, vllm_serving
    from eagle3.draft.export import load_exported_draft
    from tests.eagle3.draft_fixtures import AUX_LAYER_IDS, tiny_world

    ours, mapping = load_exported_draft(export)
    world = tiny_world()
    vllm_adapter.release_all()
    with v1_model_runner():
        llm = vllm_serving.load_serving_engine(str(world.target_dir), dtype=DTYPE, max_model_len=64, kv_cache_gib=KV_CACHE_GIB,
                                               speculative_dir=str(export), num_speculative_tokens=2, setup=eager_serving())
    prompt = torch.randint(3, 250, (13,), generator=torch.Generator().manual_seed(11)).tolist()
    theirs, first, second = first_two_draft_forwards(llm, prompt)  # prefill: 13 rows; then 1 row, the drafted token
    embed = theirs.model.embed_tokens.weight.detach().float().cpu()  # the target's, shared
    with torch.no_grad():
        aux = first["aux"].float().view(len(prompt), len(AUX_LAYER_IDS), -1)  # [T, n_aux * H] -> [T, n_aux, H]
        hidden = ours.fuse(aux)
        assert_close(hidden, first["hidden_states"], atol=1e-5)
        caches = ours.new_caches(None, len(prompt), hidden.device, hidden.dtype)
        logits0, next0 = ours.logits_and_next(ours.step(embed[first["input_ids"]], hidden, first["positions"], caches))
        assert_close(next0, first["handed_on"], atol=1e-5)
        assert_close(next0[-1:], second["hidden_states"], atol=1e-5)
        tokens = torch.zeros(len(prompt), dtype=torch.long)
        tokens[-1] = second["input_ids"][0]  # only the last row's second step is vLLM's
        logits1, _ = ours.logits_and_next(ours.step(embed[tokens], next0, first["positions"] + 1, caches))
    ids = mapping.target_ids
    assert_close(logits0, first["logits"][:, ids], what="vLLM's Llama-style draft vs ours, first forward's logits")
    assert_close(logits1[-1:], second["logits"][:, ids], what="vLLM's Llama-style draft vs ours, second forward's logits")
    assert logits0.std() > 0.1  # trained logits, not a degenerate comparison
    return theirs
