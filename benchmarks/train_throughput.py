"""Draft training throughput: the real trainer (store on disk -> TTT step) vs compute only.

On a GPU (the figures in the report): a random-weight draft for an 8B-shaped target (hidden
4096, 32/8 heads of 128, MLP 14336, target vocab 128256, draft vocab 32000), 2048-token
samples, TTT 3, bf16 autocast with fp32 master weights and fused AdamW. It prints
- attention check: the trainer's TTT attention (sink form, eagle3.draft.model) against the dense
  [L, L*(j+1)] mask definition, output and gradients, relative error, on this device;
- compute only, no TTT attention growth: every TTT step attends causally over its own keys
  only (the naive figure FIELD-NOTES quotes), one micro-batch resident on the GPU;
- compute only, real TTT attention: the trainer's batch_loss on a resident micro-batch;
- the real trainer (its CUDA defaults: bf16 weights with an fp32 master copy, and torch.compile of
  the TTT step and the loss kernels; also eager, and fp32 weights): eagle3.train.trainer.train_draft reading an extraction store written first
  with eagle3.capture.store.StoreWriter on the local disk (page cache dropped when allowed), with
  its thread-pool reader and side-stream host-to-device copies, timed from its own
  per-step progress callbacks (first steps excluded: allocator and cuBLAS warm-up);
and for each tokens/s and MFU.

FLOPs (matrix products only, per token; H=4096, q 4096, kv 2x1024, MLP 14336, Vd=32000):
  forward of one TTT step = 2*(2H*(4096+2048) + 4096*H + 3*H*14336 + H*Vd) + 4*32*128*(L/2)
                            (projections, MLP, lm_head; causal attention QK^T and PV at L/2 keys
                            on average; the few own-step keys are ignored)
  draft forward = fc 2*3H*H + 3 steps; training = 3 x draft forward (backward = 2 x forward)
  + the target's logits over the draft vocabulary, forward only: 2*H*Vd.
MFU = FLOPs/s over the measured bf16 matrix rate of this card (printed), and over 790 TFLOP/s.

    python benchmarks/train_throughput.py            # GPU, 8B shape
    python benchmarks/train_throughput.py --tiny     # CPU smoke check (seconds)
    python benchmarks/train_throughput.py --compare --accum 8   # anchor, defaults, optimizers, speculators
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train_rig import (FIELD_NOTES_NAIVE, PEAK_790, SHAPE_8B, SHAPE_TINY, _model_and_batch, _sync,  # noqa: E402, F401
                       disk_read_bandwidth, drop_page_cache, flops_per_token, matmul_rate, time_compute, time_trainer,
                       write_store, write_target)

from eagle3.train.loss import batch_loss  # noqa: E402
from eagle3.draft.model import Eagle3Draft, rope_cos_sin  # noqa: E402
from eagle3.draft.ttt_attention import ttt_attention_mask, use_varlen  # noqa: E402

def precision_probe(model, head, batch, device, flops: float, rate: float) -> None:
    """Naive compute-only tokens/s by weight precision and compilation (bf16 weights: GPU only,
    where the inputs are bf16 too)."""
    results = []
    precisions = ("fp32", "bf16") if device.type == "cuda" else ("fp32",)
    for precision in precisions:
        model.to(torch.bfloat16 if precision == "bf16" else torch.float32)
        label = "bf16 weights" if precision == "bf16" else "fp32 weights, bf16 autocast"
        results.append((f"{label}, eager", time_compute(model, head, batch, device, True, steps=10)))
        model.step = torch.compile(model.step)
        time_compute(model, head, batch, device, True, steps=1)  # compiles
        results.append((f"{label}, compiled step", time_compute(model, head, batch, device, True, steps=10)))
        del model.step  # the eager method again
    for name, tps in results:
        print(f"naive compute only, {name:40s} {tps:10,.0f} tokens/s  MFU@790 {tps * flops / PEAK_790:6.1%}  "
              f"(measured peak {tps * flops / rate:6.1%})", flush=True)


def profile_compute(model, head, batch, device) -> None:
    """Where one compute-only step's GPU time goes: forward, backward, optimizer (events), and the
    top kernels (torch.profiler, self CUDA time)."""
    from torch.profiler import ProfilerActivity, profile

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step(marks=None):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = batch_loss(model, batch, head, True)[0]
        marks and marks[0].record()
        loss.backward()
        marks and marks[1].record()
        optimizer.step()
        marks and marks[2].record()

    for _ in range(3):
        step()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    parts = []
    for _ in range(5):
        events[3].record()
        step(events[:3])
        torch.cuda.synchronize()
        parts.append([events[3].elapsed_time(events[0]), events[0].elapsed_time(events[1]),
                      events[1].elapsed_time(events[2])])
    fwd, bwd, opt = (statistics.median(p[i] for p in parts) for i in range(3))
    print(f"compute-only step: forward {fwd:.1f} ms, backward {bwd:.1f} ms, optimizer {opt:.1f} ms", flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60), flush=True)


def attention_check(model: Eagle3Draft, s: dict, device: torch.device, ttt: int) -> list[str]:
    """Relative error of the sink-form TTT attention against the dense-mask definition, out and grads."""
    c, length = model.config, min(s["seq"], 1024)
    lines = []
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator(device).manual_seed(3)
        xs = [torch.randn(length, 2 * c.hidden_size, device=device, generator=gen) for _ in range(ttt)]
        positions = torch.arange(length, device=device)
        doc_ids = (torch.arange(length, device=device) >= length // 3).long()  # two documents
        for one_doc in (True, False):
            docs = torch.zeros_like(doc_ids) if one_doc else doc_ids
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                fast = _attn_fast(model, xs, positions, None if one_doc else docs, dtype)
                ref = _attn_dense(model, xs, positions, docs)
            errors = []
            for step in range(ttt):
                errors.append(((fast[step] - ref[step]).float().norm() / ref[step].float().norm()).item())
            grads_f = torch.autograd.grad(sum(o.float().square().sum() for o in fast), xs, retain_graph=False)
            grads_r = torch.autograd.grad(sum(o.float().square().sum() for o in ref), xs)
            gerr = max(((a - b).float().norm() / b.float().norm()).item() for a, b in zip(grads_f, grads_r))
            path = "varlen" if use_varlen(None if one_doc else docs, dtype) else "sdpa"
            lines.append(f"  attention {str(dtype).removeprefix('torch.'):8s} {'1 doc ' if one_doc else '2 docs'} {path:6s}: "
                         f"out rel err per step {', '.join(f'{e:.1e}' for e in errors)}; grad rel err {gerr:.1e}")
    return lines


def _attn_fast(model, xs, positions, doc_ids, dtype):
    from eagle3.draft.ttt_attention import new_ttt_cache

    xs = [x.requires_grad_(True) for x in xs]
    cache = new_ttt_cache(doc_ids, xs[0].shape[0], xs[0].device, dtype)
    outs = []
    for step, x in enumerate(xs):
        cos, sin = rope_cos_sin(positions + step, model.inv_freq, model.rope_scaling)
        outs.append(model._attend(x, cos, sin, cache))
    return outs


def _attn_dense(model, xs, positions, doc_ids):
    """The definition: SDPA over all steps' keys under ttt_attention_mask."""
    c, attn = model.config, model.layers[0].self_attn
    length, groups = xs[0].shape[0], c.num_attention_heads // c.num_key_value_heads
    keys, values, outs = [], [], []
    for step, x in enumerate(xs):
        cos, sin = rope_cos_sin(positions + step, model.inv_freq, model.rope_scaling)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        q = attn.q_proj(x).view(length, -1, c.head_dim).transpose(0, 1)
        k = attn.k_proj(x).view(length, -1, c.head_dim).transpose(0, 1)
        v = attn.v_proj(x).view(length, -1, c.head_dim).transpose(0, 1)
        rot = lambda t: torch.cat((-t[..., t.shape[-1] // 2 :], t[..., : t.shape[-1] // 2]), -1)  # noqa: E731
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        keys.append(k)
        values.append(v)
        kk = torch.cat(keys, 1).repeat_interleave(groups, 0)
        vv = torch.cat(values, 1).repeat_interleave(groups, 0)
        mask = ttt_attention_mask(doc_ids, step)
        out = F.scaled_dot_product_attention(q[None], kk[None], vv[None], attn_mask=mask[None, None])[0]
        outs.append(attn.o_proj(out.transpose(0, 1).reshape(length, -1)))
    return outs


def packed_rows(args, s: dict, ttt: int, root: Path, target: Path, head_file: Path, vocab: Path,
                device: torch.device, flops: float, rate: float) -> None:
    """The real trainer on short samples packed several to a micro-batch (chat data): attention within each
    sample only, by varlen flash attention on CUDA (by a masked SDPA elsewhere)."""
    short = dict(s, seq=args.packed_len)
    flops = flops_per_token(short, ttt)  # attention over these samples' own keys
    count = args.samples * s["seq"] // args.packed_len
    store, _ = write_store(root / "store-packed", short, count, device)
    print(f"packed: {count} samples of {args.packed_len} tokens in micro-batches of {args.packed_batch} tokens",
          flush=True)
    for label, accum, compiled in (("defaults", 1, None), ("defaults, grad_accum 2", 2, None),
                                   ("eager (compile=false)", 1, False)):
        state = drop_page_cache() if device.type == "cuda" else "warm"
        steps = max(4, args.steps * s["seq"] // args.packed_batch // accum)
        tps, result = time_trainer(store, target, head_file, vocab, root / f"packed-{label}", short, ttt, steps, accum,
                                   args.loader_threads, compiled, "auto", batch_tokens=args.packed_batch)
        print(f"real trainer, packed, {label} (page cache {state}): {tps:,.0f} tokens/s, {tps * flops / 1e12:.0f} "
              f"TFLOP/s, MFU@790 {tps * flops / PEAK_790:.1%}, {tps / FIELD_NOTES_NAIVE:.1%} of 69,700; "
              f"{result.steps_done} steps, loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}", flush=True)


def optimizer_rows(args, s: dict, ttt: int, root: Path, store: Path, target: Path, head_file: Path, vocab: Path,
                   flops: float) -> None:
    """The real trainer's defaults (page cache warm) with train.optimizer adamw and muon, at grad_accum 1 and
    --accum: what Muon's per-step Newton-Schulz iterations cost, and how much more tokens per step amortize."""
    for optimizer in ("adamw", "muon"):
        for accum in (1, args.accum):
            steps = args.steps if accum == 1 else max(4, args.steps // accum)
            tps, result = time_trainer(store, target, head_file, vocab, root / f"opt-{optimizer}-{accum}", s, ttt, steps,
                                       accum, args.loader_threads, optimizer=optimizer)
            print(f"real trainer, defaults, optimizer {optimizer}, grad_accum {accum} (page cache warm): {tps:,.0f} "
                  f"tokens/s, MFU@790 {tps * flops / PEAK_790:.1%}; {result.steps_done} steps, loss "
                  f"{result.losses[0]:.3f} -> {result.losses[-1]:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke check)")
    parser.add_argument("--root", default="/tmp/train-throughput", help="scratch folder on the local disk")
    parser.add_argument("--samples", type=int, default=48, help="samples in the store (one micro-batch each)")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps of the real trainer")
    parser.add_argument("--loader-threads", type=int, default=4)
    parser.add_argument("--accum", type=int, default=4, help="grad_accum of the rows that accumulate")
    parser.add_argument("--profile-only", action="store_true", help="GPU: profile one compute-only step and stop")
    parser.add_argument("--compile-probe", action="store_true",
                        help="compute only, TTT attention: eager vs the draft's step under torch.compile, then stop")
    parser.add_argument("--precision-probe", action="store_true",
                        help="compute only, no TTT attention growth: fp32 weights + bf16 autocast (the trainer's) vs "
                        "bf16 weights (FIELD-NOTES' naive step may have used these), eager and compiled, then stop")
    parser.add_argument("--packed-len", type=int, default=0,
                        help="only the real trainer on samples of this many tokens, packed into micro-batches of "
                        "--packed-batch tokens (varlen attention on CUDA), then stop")
    parser.add_argument("--optimizers", action="store_true",
                        help="only the real trainer with train.optimizer adamw and muon, at grad_accum 1 and --accum")
    parser.add_argument("--compare", action="store_true",
                        help="only issue 30's rows (benchmarks/train_compare.py): the anchor, the trainer at defaults "
                        "and with AdamW and Muon at grad_accum 1 and --accum, speculators' own trainer")
    parser.add_argument("--packed-batch", type=int, default=8192, help="train.batch_tokens with --packed-len")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    s, ttt = (SHAPE_TINY if args.tiny else SHAPE_8B), 3
    root = Path(args.root)
    shutil.rmtree(root, ignore_errors=True)
    rate = matmul_rate(device)
    flops = flops_per_token(s, ttt)
    target, head_file, vocab = write_target(root, s, device)
    store, write_s = write_store(root / "store", s, args.samples, device)
    gib = sum(p.stat().st_size for p in store.iterdir()) / 2**30
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"bf16 matmul {rate / 1e12:.0f} TFLOP/s; {flops / 1e9:.2f} GFLOP per trained token", flush=True)
    print(f"store: {args.samples} x {s['seq']} tokens, {gib:.2f} GiB, written in {write_s:.1f} s", flush=True)

    if args.packed_len:
        packed_rows(args, s, ttt, root, target, head_file, vocab, device, flops, rate)
        return
    if args.compare:
        from train_compare import compare_rows

        compare_rows(args, s, ttt, root, store, target, head_file, vocab, flops, device)
        return
    if args.optimizers:
        optimizer_rows(args, s, ttt, root, store, target, head_file, vocab, flops)
        return
    model, head, batch = _model_and_batch(s, target, head_file, store, device, ttt)
    if args.profile_only:
        profile_compute(model, head, batch, device)
        return
    if args.compile_probe:
        eager = time_compute(model, head, batch, device, False, steps=10)
        started = time.perf_counter()
        model.step = torch.compile(model.step)  # one graph per TTT step shape; the loss stays eager
        time_compute(model, head, batch, device, False, steps=1)
        print(f"compile + first steps: {time.perf_counter() - started:.0f} s", flush=True)
        compiled = time_compute(model, head, batch, device, False, steps=10)
        for name, tps in (("eager", eager), ("torch.compile(step)", compiled)):
            print(f"compute only, TTT attention, {name:20s} {tps:10,.0f} tokens/s  MFU {tps * flops / rate:6.1%}")
        return
    if args.precision_probe:
        precision_probe(model, head, batch, device, flops, rate)
        return
    for line in attention_check(model, s, device, ttt):
        print(line, flush=True)
    rows = []
    for name, naive in (("compute only, no TTT attention growth", True), ("compute only, TTT attention", False)):
        rows.append((name, time_compute(model, head, batch, device, naive, steps=10 if not args.tiny else 3)))
        print(f"{name}: {rows[-1][1]:,.0f} tokens/s", flush=True)
    del model, head, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()

    cuda = device.type == "cuda"
    fp8_store, fp8_s = write_store(root / "store-fp8", s, args.samples, device, fp8=True)
    print(f"fp8 store written in {fp8_s:.1f} s", flush=True)
    if cuda:
        state = drop_page_cache()
        bandwidth = disk_read_bandwidth(store, args.loader_threads)
        print(f"disk read, page cache {state}, {args.loader_threads} threads: {bandwidth / 1e9:.2f} GB/s = "
              f"{bandwidth / (4 * s['hidden'] * 2):,.0f} tokens/s of bf16 states, "
              f"{bandwidth / (4 * s['hidden'] + 16):,.0f} of fp8", flush=True)
    # (label, store, grad_accum, page cache dropped, compile, param_dtype); the trainer's defaults on CUDA: compile
    # (None = on for CUDA) and "auto" param_dtype = bf16 weights + fp32 master
    n = args.accum
    runs = [("defaults, bf16 store, page cache warm", store, 1, False, None, "auto"),
            ("defaults, bf16 store, from disk", store, 1, True, None, "auto"),
            ("defaults, fp8 store, from disk", fp8_store, 1, True, None, "auto"),
            (f"defaults, bf16 store, from disk, grad_accum {n}", store, n, True, None, "auto"),
            ("eager (compile=false), bf16 store, from disk", store, 1, True, False, "auto"),
            (f"eager (compile=false), bf16 store, from disk, grad_accum {n}", store, n, True, False, "auto"),
            (f"fp32 weights, bf16 store, from disk, grad_accum {n}", store, n, True, None, "float32")]
    for label, path, accum, cold, compiled, param_dtype in runs:
        if not cuda and (cold or compiled):
            continue
        state = drop_page_cache() if cold else "warm"
        steps = args.steps if accum == 1 else max(4, args.steps // accum)
        tps, result = time_trainer(path, target, head_file, vocab, root / f"run-{len(rows)}", s, ttt, steps, accum,
                                   args.loader_threads, compiled, param_dtype)
        rows.append((f"real trainer: {label}", tps))
        print(f"real trainer, {label} (page cache {state}): {tps:,.0f} tokens/s; {result.steps_done} steps, "
              f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}", flush=True)

    base = rows[0][1]
    print(f"\n{'':64s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s} {'MFU@790':>8s} {'vs naive':>8s} "
          f"{'vs 69,700':>9s}")
    for name, tps in rows:
        print(f"{name:64s} {tps:10,.0f} {tps * flops / 1e12:8.0f} {tps * flops / rate:6.1%} "
              f"{tps * flops / PEAK_790:8.1%} {tps / base:8.1%} {tps / FIELD_NOTES_NAIVE:9.1%}")
    print("naive: this script's compute-only step (fp32 weights, bf16 autocast, eager); 69,700 tokens/s: "
          "FIELD-NOTES' naive eager step on an H200")


if __name__ == "__main__":
    main()
