"""eagle3: the library behind the pipeline. Pure Python + torch; never imports prefect, tasks or flows.

Packages, each importing only the ones listed before it (tests/test_layering.py checks it):

    artifacts, fingerprint   the floor: content-addressed artifacts, atomic writes, hashing
    gpu/       the GPUs: NVML, finding and stopping holders, the load preflight
    data/      what goes in: conversations and their tokenization, the target's description
               (shape, aux layer ids), the builtin targets
    capture/   what drives the engine: finding the decoder stack, the capture hooks, vLLM and HF
               sources, regeneration, extraction, the hidden-state store
    engine/    the warm engine: the target loaded once in a process of its own that runs attach to
    draft/     the draft: model, TTT attention, loss, batches, training, checkpoints, vocab
               mapping, export, simulated and served evaluation, plots
    config, stages, draft_stages   the stage entry points the Prefect tasks call
    ops/       operations around runs: publishing, the nightly increments, run summaries
"""
