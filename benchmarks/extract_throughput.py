"""Extraction throughput: plain prefill vs capture + copy + write through the store (HF backend).

On a GPU (the figures in the report): a random-weight Llama of 8B shape (hidden 4096, 32
layers, 32 heads / 8 KV heads, MLP 14336, vocab 128256, bf16) built on the GPU from its
config, batches of 8 x 2048 tokens. It prints
- the disk's write bandwidth (files written and fsynced by as many threads as the writer pool),
- plain prefill tokens/s: the inner model's forward (decoder stack, no capture, no lm_head),
- full extraction tokens/s: eagle3.capture.extract.extract_store with backend "hf" into a store on
  the local disk (capture, device->host copy, serialization, sha256, fsync, manifest),
  its ratio to the forward, bytes per token, and its share of the disk bound,
- the same for fp8 storage, and the error fp8 introduces against the bf16 store.

    python benchmarks/extract_throughput.py                # GPU, 8B shape
    python benchmarks/extract_throughput.py --tiny         # CPU smoke check (seconds)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
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


def build_model(tiny: bool, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaModel

    dtype = torch.float32 if tiny else torch.bfloat16
    config = LlamaConfig(**(SHAPE_TINY if tiny else SHAPE_8B), max_position_embeddings=8192, attn_implementation="sdpa")
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


def run_extract(model, samples, root: Path, args, dtype_name: str, threads: int) -> tuple[float, int]:  # noqa: ANN001
    """Seconds for extract_store over `samples` into a fresh store at `root`, and the store's bytes."""
    shutil.rmtree(root, ignore_errors=True)
    n = model.config.num_hidden_layers
    config = ExtractConfig(backend="hf", samples_per_shard=args.samples_per_shard, batch_tokens=args.batch * args.seq,
                           storage_dtype=dtype_name)
    device = next(model.parameters()).device
    _sync(device)
    started = time.perf_counter()
    extract_store(samples, root, get_engine=lambda: model, aux_layer_ids=default_aux_layer_ids(n), num_layers=n,
                  hidden_size=model.config.hidden_size, config=config, dtype=storage_dtype(config, "bfloat16"),
                  writer_threads=threads, max_pending_shards=args.max_pending)
    seconds = time.perf_counter() - started
    return seconds, sum(f.stat().st_size for f in root.iterdir())


def fp8_error(bf16_root: Path, fp8_root: Path, count: int) -> tuple[float, float, float]:
    """Relative error of the fp8 store against the bf16 one: (global, mean row, max row)."""
    ref_reader = StoreReader(bf16_root, dequantize_dtype=torch.float32)
    fp8_reader = StoreReader(fp8_root, dequantize_dtype=torch.float32)
    num = den = 0.0
    rows = []
    for i in range(min(count, len(ref_reader))):
        ref = ref_reader[i].hidden_states.float()  # [T, n_ids, H]
        got = fp8_reader[i].hidden_states.float()
        num += float((got - ref).pow(2).sum())
        den += float(ref.pow(2).sum())
        rows.append((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30))  # [T, n_ids]
    rel = torch.cat([r.reshape(-1) for r in rows])
    return (num / den) ** 0.5, float(rel.mean()), float(rel.max())


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny model on the CPU: a smoke check of the script")
    parser.add_argument("--batches", type=int, default=16, help="batches in each timed extraction")
    parser.add_argument("--batch", type=int, default=8, help="prompts per batch")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per prompt")
    parser.add_argument("--writer-threads", default="4", help="comma-separated: one bf16 extraction per value")
    parser.add_argument("--max-pending", type=int, default=4, help="bounded queue: shards waiting for a writer")
    parser.add_argument("--samples-per-shard", type=int, default=2)
    parser.add_argument("--disk-gib", type=float, default=4.0, help="GiB written to measure the disk")
    parser.add_argument("--profile", action="store_true",
                        help="after the table, profile one extraction of 4 batches (torch.profiler, CPU and CUDA)")
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

    started = time.perf_counter()
    model = build_model(args.tiny, device)
    _sync(device)
    print(f"model built on {device} in {time.perf_counter() - started:.1f} s", flush=True)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (args.batches * args.batch, args.seq), generator=g)
    forward = forward_tokens_per_s(model, tokens[: args.batch].to(device), iters=3 if args.tiny else 5, device=device)
    print(f"plain prefill: {forward:,.0f} tokens/s", flush=True)

    samples = [TokenizedSample(f"s{i}", row.tolist(), [1] * args.seq) for i, row in enumerate(tokens)]
    total = len(samples) * args.seq
    run_extract(model, samples[: 2 * args.batch], args.out_dir / "warm", args, "bfloat16", threads_list[0])  # warm-up
    rows = []
    for threads in threads_list:
        seconds, size = run_extract(model, samples, args.out_dir / "bf16", args, "bfloat16", threads)
        rows.append(("bfloat16", threads, total / seconds, size / total, seconds))
        print(f"bf16 extraction, {threads} writers: {total / seconds:,.0f} tokens/s ({size / seconds / 1e9:.2f} GB/s)", flush=True)
    seconds, size = run_extract(model, samples, args.out_dir / "fp8", args, "float8_e4m3", threads_list[-1])
    rows.append(("float8_e4m3", threads_list[-1], total / seconds, size / total, seconds))
    err = fp8_error(args.out_dir / "bf16", args.out_dir / "fp8", count=4)
    if args.profile:
        profile_extract(model, samples[: 4 * args.batch], args, threads_list[0])
    shutil.rmtree(args.out_dir, ignore_errors=True)

    print(f"\n{total:,} tokens per extraction ({args.batches} batches of {args.batch} x {args.seq}); "
          f"disk {disk_bw / 1e9:.2f} GB/s; plain prefill {forward:,.0f} tokens/s")
    print(f"{'storage':<12}{'writers':>8}{'tokens/s':>12}{'/forward':>10}{'B/token':>10}{'disk bound':>12}{'/min(fwd,disk)':>16}")
    for name, threads, rate, per_token, _ in rows:
        bound = disk_bw / per_token
        print(f"{name:<12}{threads:>8}{rate:>12,.0f}{rate / forward:>10.3f}{per_token:>10,.0f}{bound:>12,.0f}{rate / min(forward, bound):>16.3f}")
    print(f"fp8 vs bf16 store, relative error: global {err[0]:.4f}, per (token, layer) row mean {err[1]:.4f}, max {err[2]:.4f}")


if __name__ == "__main__":
    main()
