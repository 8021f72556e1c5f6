"""eagle3: the library behind the pipeline. Pure Python + torch; never imports prefect, tasks or flows.

Packages, each importing only the ones listed before it (tests/test_layering.py checks it):

    artifacts, fingerprint   the floor: content-addressed artifacts, atomic writes, hashing
    gpu/       the GPUs: NVML, finding and stopping holders, the load preflight
    data/      what goes in: conversations and their tokenization, the target's description
               (shape, aux layer ids), the builtin targets
    capture/   what drives the engine: finding the decoder stack, the capture hooks, vLLM and HF
               sources, regeneration, extraction, the hidden-state store
    engine/    the warm engine: the target loaded once in a process of its own that runs attach to
    draft/     the draft model: Llama-style and MLA layers, TTT attention, the target's head, vocab
               mapping, micro-batches, checkpoints, export
    evaluate/  scoring a draft: simulated acceptance, the walk, the served check, plots
    online/    the online feed: states captured while the draft trains, a remote capture worker
    train/     training: settings, loss, optimizers, the loop, DDP and torchrun
    config, stages, draft_stages   the stage entry points the Prefect tasks call
    ops/       operations around runs: publishing, the nightly increments, run summaries
"""
