"""vLLM engines that generate, with or without a draft: the served evaluation's (eagle3.evaluate.served_eval,
served_sweep, dflash_eval). What they load and how (`ServingSetup`: as `vllm serve` runs them by default), how they
run once loaded (`EngineMode`), greedy generation with top logprobs (`GreedyOutput`) and vLLM's spec-decode counters
(`SpecDecodeCounters`).

The capture engines, the pool, the workarounds and the shutdown (`vllm_adapter.shutdown_engine`, which also releases
these engines) are eagle3.capture.vllm_adapter's: this module reaches vLLM through it, so what the adapter applies
for a vLLM version (its import, engine arguments, CPU threads, MLA backends) applies here too.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eagle3.capture import process_threads, vllm_adapter, vllm_versions, vllm_workarounds
from eagle3.capture.vllm_images import Images, token_prompts
from eagle3.capture.vllm_versions import VllmUnsupported
from eagle3.gpu.preflight import target_preflight


@dataclass(frozen=True)
class SpecDecodeCounters:
    """vLLM's own spec-decode counters (`llm.get_metrics()`), summed over engines."""

    drafts: int  # vllm:spec_decode_num_drafts
    draft_tokens: int  # vllm:spec_decode_num_draft_tokens
    accepted_tokens: int  # vllm:spec_decode_num_accepted_tokens
    accepted_per_position: tuple[int, ...]  # vllm:spec_decode_num_accepted_tokens_per_pos

    def minus(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        """The counts between snapshot `before` and this one (counters are process-global)."""
        width = max(len(self.accepted_per_position), len(before.accepted_per_position))
        now = list(self.accepted_per_position) + [0] * (width - len(self.accepted_per_position))
        old = list(before.accepted_per_position) + [0] * (width - len(before.accepted_per_position))
        return SpecDecodeCounters(
            drafts=self.drafts - before.drafts,
            draft_tokens=self.draft_tokens - before.draft_tokens,
            accepted_tokens=self.accepted_tokens - before.accepted_tokens,
            accepted_per_position=tuple(a - b for a, b in zip(now, old, strict=True)),
        )


@dataclass(frozen=True)
class GreedyOutput:
    """One greedy generation: its token ids and, per generated token, the top logprobs vLLM returned."""

    token_ids: list[int]
    top_logprobs: list[dict[int, float]]  # [i]: token id -> logprob of the top-n candidates at step i
    # this request's own spec-decode counts (vLLM's per-request metrics): verify steps that had a draft, and the
    # draft tokens accepted over them; None without a draft or on a vLLM without per-request metrics
    spec_steps: int | None = None
    spec_accepted: int | None = None
    prompt_tokens: int = 0  # the prompt's length as the engine ran it (each image expanded to its image tokens)


@dataclass(frozen=True)
class ServingSetup:
    """How the served evaluation's engines run: where and how fast, never what they compute, so no fingerprint
    holds it. The defaults are what `vllm serve` does on a GPU."""

    tensor_parallel_size: int = 1  # GPUs one engine spreads the target over (the pipeline passes target.tensor_parallel_size)
    # None: vLLM's defaults (torch.compile and CUDA graphs) on a GPU, eager on the CPU build (where torch.compile
    # takes minutes on a few cores and there are no CUDA graphs); True: eager everywhere (faster to load, slower to serve)
    eager: bool | None = None
    # VLLM_CACHE_ROOT, where vLLM keeps compiled graphs so a later load of the same target skips compiling; a
    # VLLM_CACHE_ROOT already set in the environment wins. None: vLLM's own (~/.cache/vllm)
    cache_dir: str | None = None

    def eager_on(self, cpu_build: bool) -> bool:
        return True if cpu_build else bool(self.eager)


@dataclass(frozen=True)
class EngineMode:
    """How a loaded serving engine runs, read from its own config after the load (what acceptance.md states)."""

    compiled: bool  # torch.compile on (vLLM's compilation mode is not NONE)
    cuda_graphs: bool  # CUDA graphs captured (cudagraph_mode is not NONE)
    tensor_parallel_size: int
    load_seconds: float

    def describe(self) -> str:
        how = ("torch.compile and CUDA graphs" if self.compiled and self.cuda_graphs else
               "torch.compile, no CUDA graphs" if self.compiled else
               "CUDA graphs, no torch.compile" if self.cuda_graphs else "eager (no torch.compile, no CUDA graphs)")
        return f"{how}, tensor parallel {self.tensor_parallel_size}, loaded in {self.load_seconds:.1f} s"


def engine_mode(llm, load_seconds: float = 0.0) -> EngineMode:  # noqa: ANN001 - vllm.LLM
    """Read how `llm` runs from its vLLM config (the same fields vllm_adapter.check_capture_safe reads)."""
    config = llm.llm_engine.vllm_config
    return EngineMode(compiled=int(config.compilation_config.mode) != 0,
                      cuda_graphs=str(config.compilation_config.cudagraph_mode).split(".")[-1] != "NONE",
                      tensor_parallel_size=vllm_adapter.tensor_parallel_size(llm), load_seconds=round(load_seconds, 2))


def load_serving_engine(
    model_dir: str,
    *,
    dtype: str,
    max_model_len: int,
    kv_cache_gib: float,
    seed: int = 0,
    speculative_dir: str | None = None,
    num_speculative_tokens: int = 0,
    images: bool = False,
    speculative_method: str = "eagle3",
    setup: ServingSetup = ServingSetup(),
):  # noqa: ANN201 - vllm.LLM
    """An engine for generation (not capture), optionally speculating with an EAGLE-3 draft folder (or, with
    speculative_method "dflash", a DFlash folder: eagle3.draft.dflash_export).

    Run as `vllm serve` runs it by default (`setup`): on a GPU with torch.compile and CUDA graphs, at the target's
    tensor parallel size; on the CPU build eager. Not pooled: the served evaluation loads the target twice, with
    and without the draft, and releases each with `shutdown_engine`. Stats logging is on, or the spec-decode
    counters stay empty. Token-id prompts only (no tokenizer is loaded, so folders without one work too); `images`:
    prompts may carry images (vLLM's multimodal processor needs the target's tokenizer, so it is loaded).
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if setup.cache_dir:
        os.environ.setdefault("VLLM_CACHE_ROOT", str(setup.cache_dir))
    vllm_adapter._cpu_thread_env(setup.tensor_parallel_size)
    vllm = vllm_adapter._import_vllm()
    from vllm.platforms import current_platform

    speculative = None
    if speculative_dir is not None:
        if num_speculative_tokens < 1:
            raise VllmUnsupported(f"num_speculative_tokens is {num_speculative_tokens}; expected >= 1 with a draft")
        speculative = {"method": speculative_method, "model": str(speculative_dir),
                       "num_speculative_tokens": num_speculative_tokens}
        vllm_workarounds.patch_cpu_spec_decode_kernels(vllm.__version__)  # in-process engine (set above): the patch is where the runner is
        if speculative_method == "dflash":
            vllm_workarounds.patch_cpu_dflash_context_norm()
    attention_backend = vllm_adapter.mla_attention_backend(str(model_dir), dtype, dtype_setting="eval.served_dtype")
    if speculative is not None and attention_backend is not None:
        # an MLA draft takes its backend from here, never from the target (v1/spec_decode/llm_base_proposer.py):
        # on an AMX CPU a float32 draft would pick AMX_MLA and refuse its weights
        speculative["attention_backend"] = attention_backend
    # before any load: does the target fit the GPUs this engine gets at this tensor parallel size?
    checked = target_preflight(Path(model_dir), setup.tensor_parallel_size, kv_cache_gib,
                               kv_setting="eval.served_kv_cache_gib")
    process_threads.remember()  # put back by vllm_adapter.shutdown_engine
    per_request = vllm_versions.serving_options(vllm_versions.features(vllm.__version__), speculative=speculative is not None)
    return vllm_adapter._new_llm(
        vllm,
        **gpu_share_free_now(checked),
        model=str(model_dir),
        dtype=dtype,
        max_model_len=max_model_len,
        enforce_eager=setup.eager_on(current_platform.is_cpu()),
        enable_prefix_caching=False,
        tensor_parallel_size=setup.tensor_parallel_size,
        distributed_executor_backend="uni" if setup.tensor_parallel_size == 1 else "mp",
        seed=seed,
        disable_log_stats=False,
        skip_tokenizer_init=not images,
        speculative_config=speculative,
        attention_backend=attention_backend,
        **vllm_adapter.kv_cache_options(kv_cache_gib),
        **per_request,
    )


VLLM_GPU_SHARE = 0.92  # vLLM's default gpu_memory_utilization


def gpu_share_free_now(preflight: dict) -> dict:
    """gpu_memory_utilization for a serving engine, from its preflight's NVML reading of the GPUs it takes
    (target_preflight's "gpus"): vLLM's default (nothing passed) where that much of each GPU is free, else the
    share free on the fullest one less 1 GiB (the new engine's CUDA context and a margin). vLLM refuses to start
    when less than its share is free, and after a compiled engine with CUDA graphs is shut down in this process,
    vLLM 0.25 keeps 9.2 of an H100's 79 GiB (the served evaluation loads the target twice, the sweep more often).
    Nothing where NVML read no GPU (the CPU build)."""
    gpus = preflight.get("gpus") or []
    if not gpus:
        return {}
    share = math.floor(1000 * min((g["free_mib"] - 1024) / g["total_mib"] for g in gpus)) / 1000  # down: never more
    if share >= VLLM_GPU_SHARE:
        return {}
    print(f"serving engine: {1 - share:.0%} of a GPU is taken before it starts (an earlier engine of this process, "
          f"or another process); it gets gpu_memory_utilization {share:.3f} instead of vLLM's {VLLM_GPU_SHARE}",
          flush=True)
    return {"gpu_memory_utilization": share}


def greedy_generate(llm, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, num_logprobs: int = 2,  # noqa: ANN001
                    images: Images | None = None) -> list[GreedyOutput]:
    """Greedy (temperature 0) generation from token-id prompts, in prompt order, with top logprobs; `images`: per
    prompt its image URLs (an engine loaded with images=True)."""
    vllm = vllm_adapter._import_vllm()
    params = vllm.SamplingParams(max_tokens=max_new_tokens, temperature=0.0, logprobs=num_logprobs or None)
    outputs = llm.generate(token_prompts(llm, prompts, images), params, use_tqdm=False)
    results = []
    for out in outputs:
        completion = out.outputs[0]
        steps = completion.logprobs or []
        tops = [{int(t): float(lp.logprob) for t, lp in step.items()} for step in steps]
        metrics = getattr(completion, "spec_decode_metrics", None)
        histogram = list(getattr(metrics, "histogram", None) or [])
        results.append(GreedyOutput(
            token_ids=list(completion.token_ids), top_logprobs=tops,
            prompt_tokens=len(out.prompt_token_ids or ()),
            spec_steps=sum(histogram) if metrics is not None else None,
            spec_accepted=sum(j * count for j, count in enumerate(histogram)) if metrics is not None else None))
    return results


def spec_decode_counters(llm) -> SpecDecodeCounters:  # noqa: ANN001 - vllm.LLM
    """Read vLLM's spec-decode counters (all zero when the engine does not speculate)."""
    totals = {"vllm:spec_decode_num_drafts": 0, "vllm:spec_decode_num_draft_tokens": 0,
              "vllm:spec_decode_num_accepted_tokens": 0}
    per_position: list[int] = []
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = [int(v) for v in metric.values]
            width = max(len(values), len(per_position))
            padded = [per_position + [0] * (width - len(per_position)), values + [0] * (width - len(values))]
            per_position = [a + b for a, b in zip(*padded, strict=True)]
    return SpecDecodeCounters(
        drafts=totals["vllm:spec_decode_num_drafts"],
        draft_tokens=totals["vllm:spec_decode_num_draft_tokens"],
        accepted_tokens=totals["vllm:spec_decode_num_accepted_tokens"],
        accepted_per_position=tuple(per_position),
    )
