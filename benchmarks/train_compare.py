"""Issue 30's rows of benchmarks/train_throughput.py --compare, in one process, the same store and shape:

- the anchor: a compute-only EAGLE-3 training step (FIELD-NOTES' naive step: bf16 weights, eager, no TTT
  attention growth, fused AdamW, one resident micro-batch of B=1 x 2048 tokens, no data loading);
- Muon's optimizer step alone on the draft's hidden matrices: torch.optim.Muon (one matrix after another)
  against eagle3.train.optim.BatchedMuon (batched by shape), and the Newton-Schulz FLOPs per step;
- the real trainer at its defaults (train.tokens_per_step 'auto': 16,384 tokens a step on CUDA) with AdamW
  and with Muon, and with each optimizer at exactly grad_accum 1 and --accum;
- speculators 0.9.0's own trainer at the same shape (benchmarks/speculators_throughput.py), when it imports;
then a table of tokens/s against the anchor, and the issue's two goals.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from train_rig import PEAK_790, _model_and_batch, _sync, time_compute, time_trainer

from eagle3.train.optim import BatchedMuon


def newton_schulz_flops(shapes: list[torch.Size], steps: int = 5) -> float:
    """Matrix-product FLOPs of `steps` quintic iterations over matrices of `shapes` ([r, c] -> short x long)."""
    total = 0.0
    for shape in shapes:
        r, c = min(shape), max(shape)
        total += steps * (2 * r * r * c + 2 * r * r * r + 2 * r * r * c)  # X X^T, (X X^T)^2, (.) X
    return total


def muon_step_rows(model: torch.nn.Module, device: torch.device) -> list[str]:
    """ms of one Muon step over the draft's hidden matrices (fp32 master copies, random gradients)."""
    hidden = [p.detach().float().clone().requires_grad_(True) for n, p in model.named_parameters()
              if p.ndim == 2 and min(p.shape) > 1 and "lm_head" not in n]
    for p in hidden:
        p.grad = torch.randn_like(p)
    flops = newton_schulz_flops([p.shape for p in hidden])
    lines = []
    for name, kind in (("torch.optim.Muon", torch.optim.Muon), ("BatchedMuon", BatchedMuon)):
        optimizer = kind(hidden, lr=1e-5, weight_decay=0.1, momentum=0.95, nesterov=True,
                         adjust_lr_fn="match_rms_adamw")
        times = []
        for i in range(7):
            _sync()
            started = time.perf_counter()
            optimizer.step()
            _sync()
            if i >= 2:
                times.append(time.perf_counter() - started)
        ms = statistics.median(times) * 1e3
        lines.append(f"Muon step alone, {name:16s}: {ms:6.1f} ms over {len(hidden)} matrices, Newton-Schulz "
                     f"{flops / 1e12:.1f} TFLOP = {flops / (ms / 1e3) / 1e12:.0f} TFLOP/s")
    return lines


def compare_rows(args, s: dict, ttt: int, root: Path, store: Path, target: Path, head_file: Path, vocab: Path,  # noqa: ANN001
                 flops: float, device: torch.device) -> None:
    model, head, batch = _model_and_batch(s, target, head_file, store, device, ttt)
    for line in muon_step_rows(model, device):
        print(line, flush=True)
    if device.type == "cuda":
        model.to(torch.bfloat16)  # the naive step's bf16 weights (its inputs are bf16 on CUDA)
    anchor = time_compute(model, head, batch, device, naive=True, steps=20 if device.type == "cuda" else 3)
    print(f"anchor, compute-only EAGLE-3 step, B=1 x {s['seq']}: {anchor:,.0f} tokens/s", flush=True)
    del model, head, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    n = args.accum
    runs = [("ours, defaults (AdamW, tokens_per_step auto)", "adamw", 1, "auto"),
            ("ours, defaults with Muon (tokens_per_step auto)", "muon", 1, "auto"),
            ("ours, AdamW, grad_accum 1", "adamw", 1, None), (f"ours, AdamW, grad_accum {n}", "adamw", n, None),
            ("ours, Muon, grad_accum 1", "muon", 1, None), (f"ours, Muon, grad_accum {n}", "muon", n, None)]
    rows = [("anchor, B=1", anchor)]
    for label, optimizer, accum, tokens_per_step in runs:
        big = accum > 1 or (tokens_per_step == "auto" and device.type == "cuda")
        steps = max(6, args.steps // n) if big else args.steps
        tps, result = time_trainer(store, target, head_file, vocab, root / f"cmp-{len(rows)}", s, ttt, steps, accum,
                                   args.loader_threads, optimizer=optimizer, tokens_per_step=tokens_per_step)
        rows.append((label, tps))
        print(f"{label}: {tps:,.0f} tokens/s, MFU@790 {tps * flops / PEAK_790:.1%}; {result.steps_done} steps, "
              f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}", flush=True)
    rows += _speculators_row(args)
    _table(rows, n)


def _speculators_row(args) -> list[tuple[str, float]]:  # noqa: ANN001
    import argparse

    try:
        import speculators_throughput
    except ImportError as err:
        print(f"speculators' trainer: not run ({err})", flush=True)
        return []
    spec_args = argparse.Namespace(tiny=args.tiny, root=str(Path(args.root) / "speculators"), samples=args.samples,
                                   steps=args.steps, workers=4)
    try:
        tps = speculators_throughput.run(spec_args)
    except (RuntimeError, OSError) as err:
        print(f"speculators' trainer failed: {str(err)[-2000:]}", flush=True)
        return []
    print(f"speculators 0.9.0's trainer (AdamW, its fused loss): {tps:,.0f} tokens/s", flush=True)
    return [("speculators 0.9.0's trainer, AdamW", tps)]


def _table(rows: list[tuple[str, float]], n: int) -> None:
    anchor = rows[0][1]
    print(f"\n{'':52s} {'tokens/s':>10s} {'/ anchor':>9s}")
    for name, tps in rows:
        print(f"{name:52s} {tps:10,.0f} {tps / anchor:9.3f}")
    by = dict(rows)
    adamw1, muon1 = by["ours, AdamW, grad_accum 1"], by["ours, Muon, grad_accum 1"]
    defaults = [by["ours, defaults (AdamW, tokens_per_step auto)"], by["ours, defaults with Muon (tokens_per_step auto)"]]
    print(f"goal: defaults >= 0.95 of the anchor: AdamW {defaults[0] / anchor:.3f}, Muon {defaults[1] / anchor:.3f}")
    print(f"goal: Muon at grad_accum 1 >= 0.9 of AdamW at grad_accum 1: {muon1 / adamw1:.3f}")
    theirs = by.get("speculators 0.9.0's trainer, AdamW")
    if theirs:
        print(f"ours at defaults (AdamW) / speculators: {defaults[0] / theirs:.2f}; ours at grad_accum 1 / "
              f"speculators: {adamw1 / theirs:.2f}")
