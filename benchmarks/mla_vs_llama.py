"""Training throughput of the MLA draft against the Llama-style draft at Kimi-K2.5's shape, side by side (issue 27).

Both drafts come from the project's own path (eagle3.draft.architecture.draft_config_for on a Kimi-K2.5-shaped
text config: hidden 7168, 64 heads, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128, MLP 18432, vocab 163840,
YaRN factor 64): train.draft.architecture deepseek_mla, and llama, whose heads the Llama path takes from the
same config (64 query and 64 KV heads of hidden/heads = 112). Draft vocabulary 32000, 3 aux states.

Each is trained as the trainer trains on CUDA: bf16 weights with an fp32 master copy and fused AdamW, bf16
autocast, TTT 3, the trainer's loss (eagle3.train.loss.batch_loss), 8 micro-batches of 2048 tokens per
optimizer step (train.tokens_per_step 'auto' on CUDA), each micro-batch one 2048-token sample resident on the
GPU (random states and tokens; no disk). Eager first, then with the trainer's torch.compile (the TTT step and
the loss kernels). Median step time of the timed steps after warm-up; peak memory from torch.cuda.

FLOPs per token (matrix products only; H=7168, I=18432, Vd=32000, L=2048, n heads):
  Llama-style step = 2*(2H*(q+2kv) + q*H + 3*H*I + H*Vd) + 4*n*hd*(L/2)             (q = kv = n*hd)
  MLA step         = 2*(2H*ql + ql*n*(p+r) + 2H*(kl+r) + kl*n*(p+v) + n*v*H + 3*H*I + H*Vd)
                     + 2*n*(p+r)*(L/2) + 2*n*v*(L/2)                                (QK^T and PV at L/2 keys)
  training = 3 x (fc 2*3H*H + 3 steps) + the target's logits over Vd, 2*H*Vd; MFU over 790 TFLOP/s (bf16).

    python benchmarks/mla_vs_llama.py            # GPU (the figures in benchmarks/results)
    python benchmarks/mla_vs_llama.py --tiny     # CPU smoke check, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3.capture.store import Sample  # noqa: E402
from eagle3.draft.architecture import DraftSettings, build_draft, draft_config_for  # noqa: E402
from eagle3.draft.batches import pack  # noqa: E402
from eagle3.train.loss import EAGER, batch_loss, compiled_kernels  # noqa: E402
from eagle3.draft.target_head import TargetHead  # noqa: E402

KIMI = dict(hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=18432, vocab_size=163840,
            rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0,
                             "mscale": 1.0, "mscale_all_dim": 1.0},
            max_position_embeddings=262144)
TINY = dict(KIMI, hidden_size=64, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, qk_nope_head_dim=32,
            v_head_dim=32, intermediate_size=128, vocab_size=512)
PEAK = 790e12


def write_target(root: Path, shape: dict) -> Path:
    """A Kimi-K2.5-shaped DeepseekV3 text config.json (no weights: the drafts take only their shape from it)."""
    config = dict(shape, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_hidden_layers=61,
                  rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


def flops_per_token(c, seq: int, ttt: int = 3) -> float:  # noqa: ANN001 - DraftConfig | MLADraftConfig
    h, i, vd = c.hidden_size, c.intermediate_size, c.draft_vocab_size
    if getattr(c, "architecture", "llama") == "deepseek_mla":
        n, ql, kl, p, r, v = (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
                              c.qk_rope_head_dim, c.v_head_dim)
        step = 2 * (2 * h * ql + ql * n * (p + r) + 2 * h * (kl + r) + kl * n * (p + v) + n * v * h + 3 * h * i + h * vd)
        step += 2 * n * (p + r) * (seq / 2) + 2 * n * v * (seq / 2)
    else:
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        step = 2 * (2 * h * (q + 2 * kv) + q * h + 3 * h * i + h * vd) + 4 * c.num_attention_heads * c.head_dim * (seq / 2)
    return 3 * (2 * 3 * h * h + ttt * step) + 2 * h * vd


def run_one(architecture: str, target: Path, shape: dict, device: torch.device, args: argparse.Namespace,
            compiled: bool, log) -> dict:  # noqa: ANN001 - a file
    config = draft_config_for(DraftSettings(architecture=architecture), target, num_aux_hidden_states=3,
                              draft_vocab_size=args.draft_vocab)
    model = build_draft(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    bf16 = device.type == "cuda"
    master = [p.detach().clone().float() for p in model.parameters()]  # fp32: what the optimizer updates
    if bf16:
        model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(master, lr=1e-5, fused=device.type == "cuda")
    dtype = torch.bfloat16 if bf16 else torch.float32
    g = torch.Generator(device).manual_seed(0)
    h, vocab = shape["hidden_size"], shape["vocab_size"]
    head = TargetHead(embed=torch.randn(vocab, h, device=device, generator=g, dtype=dtype) * 0.02,
                      norm_weight=torch.ones(h, device=device, dtype=dtype), norm_eps=1e-6,
                      lm_head=torch.randn(args.draft_vocab, h, device=device, generator=g, dtype=dtype) * 0.02)
    batches = []
    for k in range(args.accum):  # resident micro-batches, one sample each
        states = torch.randn(args.seq, 4, h, generator=torch.Generator().manual_seed(k), dtype=dtype)  # [T, 3+1, H]
        tokens = torch.randint(0, vocab, (args.seq,), generator=torch.Generator().manual_seed(k))
        mask = torch.ones(args.seq, dtype=torch.bool)
        batches.append(pack([Sample(f"s{k}", tokens, mask, states)], 3, args.seq).map(lambda t: t.to(device)))
    kernels = EAGER
    if compiled:
        from torch import _dynamo

        _dynamo.config.cache_size_limit = max(_dynamo.config.cache_size_limit, 48)  # a graph per TTT step
        model.step = torch.compile(model.step, dynamic=True)
        kernels = compiled_kernels()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.warmup + args.steps):
        _sync(device)
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        for batch in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss, _ = batch_loss(model, batch, head, True, kernels)
            (loss / len(batches)).backward()
        for m, p in zip(master, model.parameters(), strict=True):
            m.grad = p.grad.float()
        torch.nn.utils.clip_grad_norm_(master, 1.0)
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(master, model.parameters(), strict=True):
                p.copy_(m)
        loss.item()
        seconds = time.perf_counter() - start
        print(f"  {architecture} {'compiled' if compiled else 'eager'} step {i}: {seconds:.3f} s, loss {loss.item():.4f}",
              file=log, flush=True)
        if i >= args.warmup:
            times.append(seconds)
    tokens = args.accum * args.seq
    tps = tokens / statistics.median(times)
    flops = flops_per_token(config, args.seq)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"architecture": architecture, "compiled": compiled, "params": params, "tokens_per_step": tokens,
            "step_seconds": statistics.median(times), "tokens_per_s": tps, "flops_per_token": flops,
            "mfu_790": tps * flops / PEAK, "peak_gib": peak}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke check at a tiny shape")
    parser.add_argument("--out", type=Path, default=None, help="folder for log.txt and results.json")
    parser.add_argument("--no-compile", action="store_true", help="eager only")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    shape = TINY if args.tiny else KIMI
    args.seq, args.accum, args.draft_vocab = (64, 2, 256) if args.tiny else (2048, 8, 32000)
    args.warmup, args.steps = (1, 2) if args.tiny else (2, 5)
    out = args.out or Path(tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    target = write_target(out / "target", shape)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    results = []
    with open(out / "log.txt", "a") as log:
        print(f"device {name}, torch {torch.__version__}, shape {json.dumps(shape)}", file=log, flush=True)
        for compiled in (False,) if args.no_compile else (False, True):
            for architecture in ("deepseek_mla", "llama"):
                try:
                    results.append(run_one(architecture, target, shape, device, args, compiled, log))
                except Exception as err:  # noqa: BLE001 - a compile failure must not lose the other figures
                    print(f"{architecture} {'compiled' if compiled else 'eager'} failed: {type(err).__name__}: "
                          f"{str(err)[:500]}", file=log, flush=True)
                    print(f"{architecture} {'compiled' if compiled else 'eager'} failed: {type(err).__name__}", flush=True)
                (out / "results.json").write_text(json.dumps(results, indent=1))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print(f"{name}, torch {torch.__version__}: {args.accum} x {args.seq} tokens per optimizer step, TTT 3, "
          f"draft vocab {args.draft_vocab}, bf16 weights + fp32 master, fused AdamW")
    print(f"{'draft':14s} {'mode':9s} {'params':>8s} {'tokens/s':>10s} {'step s':>7s} {'GFLOP/tok':>10s} "
          f"{'MFU@790':>8s} {'peak GiB':>9s}")
    for r in results:
        print(f"{r['architecture']:14s} {'compiled' if r['compiled'] else 'eager':9s} {r['params'] / 1e9:7.3f}B "
              f"{r['tokens_per_s']:10,.0f} {r['step_seconds']:7.3f} {r['flops_per_token'] / 1e9:10.2f} "
              f"{r['mfu_790']:8.1%} {r['peak_gib']:9.1f}")


if __name__ == "__main__":
    main()
