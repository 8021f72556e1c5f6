"""What vLLM's own EAGLE-3 draft computes while it serves: its first two forward calls on one prompt.

Shared by the tests that hold our draft module against vLLM's (test_mla_draft, test_eagle_3_1).
"""

from __future__ import annotations

import torch


def first_two_draft_forwards(llm, prompt: list[int]) -> tuple[torch.nn.Module, dict, dict]:  # noqa: ANN001 - vllm.LLM
    """Greedy-generate 2 tokens from `prompt` on an in-process engine that serves a draft, shut the engine down, and
    return (vLLM's draft module, its first forward, its second): the first reads the whole prompt, the second the
    one token the first drafted. Each call: input_ids, positions, hidden_states (what the forward read), aux (the
    target's aux states before any norm, [T, n_aux*H]), fc_input (what fc read), logits (over the target vocabulary)
    and handed_on (the hidden the forward hands the next step)."""
    from eagle3.capture import vllm_adapter

    try:
        model = llm.collective_rpc(lambda worker: worker.model_runner)[0].drafter.model
        calls: list[dict] = []
        aux: list[torch.Tensor] = []
        fc_inputs: list[torch.Tensor] = []
        combine = model.combine_hidden_states
        model.combine_hidden_states = lambda states: (aux.append(states.detach().clone()), combine(states))[1]
        model.model.fc.register_forward_hook(lambda m, args, out: fc_inputs.append(args[0].detach().clone()))

        def record(module, args, kwargs, out):  # noqa: ANN001, ANN202
            calls.append({"input_ids": kwargs["input_ids"].clone(), "positions": kwargs["positions"].clone(),
                          "hidden_states": kwargs["hidden_states"].clone(), "aux": aux[-1] if aux else None,
                          "fc_input": fc_inputs[-1] if fc_inputs else None,
                          "logits": module.compute_logits(out[0]).detach().clone(), "handed_on": out[1].detach().clone()})

        model.register_forward_hook(record, with_kwargs=True)
        vllm_adapter.greedy_generate(llm, [prompt], max_new_tokens=2)
    finally:
        vllm_adapter.shutdown_engine(llm)
    first, second = calls[0], calls[1]
    assert first["input_ids"].shape[0] == len(prompt) and second["input_ids"].shape[0] == 1
    return model, first, second
