"""Where the trainer's time goes on samples of varying length (issue 30's finding of 2026-12-02: ~15,400 tokens/s on
lengths 1,025..2,048 against ~65,500 on samples of 2,048 tokens, same trainer and settings).

On a GPU, an 8B-shaped draft (benchmarks/train_throughput.py's shape), one sample a micro-batch, bf16 autocast, fused
AdamW, the step compiled as the trainer compiles it (dynamic shapes) or eager. Each row runs the same number of steps
on micro-batches resident on the device, so data loading is out of it:
- fixed:   every micro-batch 2,048 tokens;
- varying: lengths drawn uniformly from 1,025..2,048 (a new length nearly every micro-batch);
- bucketed: the varying micro-batches, each padded at its end to the next multiple of --bucket tokens (weights 0
           there: the loss of the real rows is unchanged; causal attention never looks ahead);
and prints tokens/s (real tokens, padding not counted) and what the CUDA caching allocator did while the row ran
(cudaMalloc calls, retries after a failed cudaMalloc: each frees the cache and synchronizes). Then a profile of a few
varying-length steps (self CPU and self CUDA time). `--alloc-conf` runs the rows again in a child process with
PYTORCH_CUDA_ALLOC_CONF set (it must be set before CUDA starts).

    python benchmarks/train_varlen.py                                   # GPU
    python benchmarks/train_varlen.py --cudnn --modes eager             # as before 2026-12-03 (cuDNN attention)
    python benchmarks/train_varlen.py --alloc-conf expandable_segments:True
    python benchmarks/train_varlen.py --tiny                            # CPU smoke check (seconds)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_rig import SHAPE_8B, SHAPE_TINY, _sync, write_target  # noqa: E402

from eagle3.capture.store import Sample  # noqa: E402
from eagle3.draft import ttt_attention  # noqa: E402
from eagle3.draft.batches import MicroBatch, pack  # noqa: E402
from eagle3.train.loss import EAGER, batch_loss, compiled_kernels  # noqa: E402
from eagle3.draft.model import DraftConfig, Eagle3Draft  # noqa: E402
from eagle3.draft.target_head import TargetHead, load_target_head, read_target_config  # noqa: E402

ALLOC_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def lengths_for(kind: str, s: dict, count: int, bucket: int) -> list[tuple[int, int]]:
    """(real tokens, tokens in the micro-batch) per micro-batch."""
    seq = s["seq"]
    if kind == "fixed":
        return [(seq, seq)] * count
    gen = torch.Generator().manual_seed(5)
    real = torch.randint(seq // 2 + 1, seq + 1, (count,), generator=gen).tolist()
    if kind == "varying":
        return [(n, n) for n in real]
    return [(n, min(seq, -(-n // bucket) * bucket)) for n in real]


def make_batches(s: dict, shape: list[tuple[int, int]], device: torch.device, ttt: int) -> list[MicroBatch]:
    """Random micro-batches on the device; padding rows (past the real length) carry no loss."""
    gen = torch.Generator().manual_seed(6)
    batches = []
    for real, total in shape:
        mask = torch.ones(total, dtype=torch.bool)
        mask[: real // 8] = False  # a prompt
        mask[real:] = False  # padding
        sample = Sample("s", torch.randint(0, s["vocab"], (total,), generator=gen), mask,
                        torch.randn(total, 4, s["hidden"], generator=gen).to(torch.bfloat16))
        batches.append(pack([sample], ttt, total).map(lambda t: t.to(device)))
    return batches


def run_row(model: Eagle3Draft, head: TargetHead, batches: list[MicroBatch], real: int, device: torch.device,
            kernels, warmup: int) -> tuple[float, dict[str, int]]:  # noqa: ANN001
    """Tokens/s over the batches after `warmup` of them, and the allocator's counters in that time."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    cuda = device.type == "cuda"

    def step(batch: MicroBatch) -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = batch_loss(model, batch, head, True, kernels)[0]
        loss.backward()
        optimizer.step()

    for batch in batches[:warmup]:
        step(batch)
    _sync()
    before = torch.cuda.memory_stats() if cuda else {}
    started = time.perf_counter()
    for batch in batches[warmup:]:
        step(batch)
    _sync()
    seconds = time.perf_counter() - started
    after = torch.cuda.memory_stats() if cuda else {}
    return real / seconds, {k: after.get(k, 0) - before.get(k, 0) for k in ALLOC_KEYS}


def profile_rows(model: Eagle3Draft, head: TargetHead, batches: list[MicroBatch], device: torch.device,
                 kernels) -> None:  # noqa: ANN001
    from torch.profiler import ProfilerActivity, profile

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = batch_loss(model, batch, head, True, kernels)[0]
            loss.backward()
            optimizer.step()
        _sync()
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=55), flush=True)
    if device.type == "cuda":
        print(table.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=55), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke check)")
    parser.add_argument("--steps", type=int, default=40, help="timed micro-batches per row")
    parser.add_argument("--bucket", type=int, default=256, help="the bucketed rows pad to a multiple of this")
    parser.add_argument("--modes", default="eager,compiled", help="eager, compiled or both")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--alloc-conf", help="also run the rows in a child with PYTORCH_CUDA_ALLOC_CONF=this")
    parser.add_argument("--root", default="/tmp/train-varlen")
    parser.add_argument("--cudnn", action="store_true", help="let the draft's attention use cuDNN's SDPA too (what "
                        "the trainer did before 2026-12-03: a new execution plan for every new length)")
    args = parser.parse_args()
    if args.cudnn:
        ttt_attention.SDPA_BACKENDS.insert(0, SDPBackend.CUDNN_ATTENTION)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    s, ttt = dict(SHAPE_TINY if args.tiny else SHAPE_8B), 3
    target, head_file, _ = write_target(Path(args.root), s, device)
    config = DraftConfig.from_target(read_target_config(target), num_aux_hidden_states=3, draft_vocab_size=s["draft_vocab"])
    full = load_target_head(head_file, read_target_config(target))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head = TargetHead(full.embed, full.norm_weight, full.norm_eps, full.lm_head[: s["draft_vocab"]]).to(dtype, device)
    print(f"device {device}, torch {torch.__version__}, SDPA backends "
          f"{[b.name for b in ttt_attention.SDPA_BACKENDS]}, PYTORCH_CUDA_ALLOC_CONF="
          f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}, {args.steps} timed micro-batches a row", flush=True)
    warmup = 6
    for mode in args.modes.split(","):
        model = Eagle3Draft(config).to(device)
        kernels = EAGER
        if mode == "compiled":
            torch._dynamo.config.cache_size_limit = 64
            model.step = torch.compile(model.step, dynamic=True)
            kernels = compiled_kernels()
        for kind in ("fixed", "varying", "bucketed"):
            shape = lengths_for(kind, s, warmup + args.steps, args.bucket)
            batches = make_batches(s, shape, device, ttt)
            real = sum(n for n, _ in shape[warmup:])
            padded = sum(t for _, t in shape[warmup:])
            started = time.perf_counter()
            tps, alloc = run_row(model, head, batches, real, device, kernels, warmup)
            print(f"{mode:8s} {kind:8s}: {tps:9,.0f} tokens/s  (mean length {real / args.steps:,.0f}, padded "
                  f"{padded / real - 1:5.1%}; row {time.perf_counter() - started:.0f} s)  allocator while timed: "
                  + ", ".join(f"{k} {v}" for k, v in alloc.items()), flush=True)
            del batches
        if not args.no_profile and mode == args.modes.split(",")[-1]:
            batches = make_batches(s, lengths_for("varying", s, 4, args.bucket), device, ttt)
            print(f"profile: 4 varying-length micro-batches, {mode}", flush=True)
            profile_rows(model, head, batches, device, kernels)
    if args.alloc_conf:
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=args.alloc_conf)
        argv = ["--steps", str(args.steps), "--bucket", str(args.bucket), "--modes", args.modes, "--root", args.root,
                "--no-profile"] + (["--tiny"] if args.tiny else []) + (["--cudnn"] if args.cudnn else [])
        subprocess.run([sys.executable, __file__, *argv], env=env, check=False)


if __name__ == "__main__":
    main()
