"""The warm engine: the target loaded once into a process of its own, that runs attach to.

    registry   where an engine lives (<cache_dir>/engines/<engine fingerprint>/), its key, its record
    server     the engine process: `vllm.LLM` + the capture, answering over a Unix socket
    client     attach (or start one), generate, capture, release; the records a run keeps
    pool       what the stages call: a warm engine when one is live or may stay warm, else in-process
    endpoint   regeneration against an OpenAI-compatible server the user already runs
"""
