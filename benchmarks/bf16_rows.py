"""Does a bf16 linear layer's output row depend on how many rows are in the batch (M)? (torch CPU, oneDNN)

For SmolLM2-135M's projection shapes, y_M = x[:M] @ W.T in bf16; row 0 of y_M is compared bit for bit
with row 0 of y_1 (one token alone, as plain decoding computes it). Prints, per shape and M, how many of
row 0's elements differ and the largest difference. A second table runs a 30-layer residual stack of
such layers (random weights, RMS-normed), to show how far the rows drift after 30 layers.
"""
import os
import sys

import torch

torch.manual_seed(0)
flags = open("/proc/cpuinfo").read()
print("cpu:", next((l.split(":", 1)[1].strip() for l in flags.splitlines() if l.startswith("model name")), "?"),
      "| amx_bf16:", "amx_bf16" in flags, "| avx512_bf16:", "avx512_bf16" in flags,
      "| ONEDNN_MAX_CPU_ISA:", os.environ.get("ONEDNN_MAX_CPU_ISA", "-"), "| torch", torch.__version__,
      "| threads", torch.get_num_threads(), flush=True)
shapes = {"o_proj": (576, 576), "qkv_proj": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
Ms = [1, 2, 4, 5, 8, 16, 33, 64, 132]
print("shape      " + " ".join(f"M={m:<4}" for m in Ms[1:]) + "   (elements of row 0 differing from M=1, of N)")
for name, (n, k) in shapes.items():
    w = (torch.randn(n, k) / k**0.5).bfloat16()
    x = torch.randn(max(Ms), k).bfloat16()
    ref = torch.nn.functional.linear(x[:1], w)[0]
    cells = []
    for m in Ms[1:]:
        y = torch.nn.functional.linear(x[:m], w)[0]
        cells.append(f"{int((y != ref).sum()):<6}")
    print(f"{name:<10} " + " ".join(cells) + f"  N={n}", flush=True)

# 30 layers: h <- h + W2 silu(W1 rmsnorm(h)) with SmolLM2's widths; logits through a 49152 x 576 head.
layers = [((torch.randn(1536, 576) / 24).bfloat16(), (torch.randn(576, 1536) / 39).bfloat16()) for _ in range(30)]
head = (torch.randn(49152, 576) / 24 * 8).bfloat16()
x0 = torch.randn(max(Ms), 576).bfloat16()


def logits(h: torch.Tensor) -> torch.Tensor:
    for w1, w2 in layers:
        z = h.float()
        z = (z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
        h = h + torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(z, w1)), w2)
    return torch.nn.functional.linear(h, head).float()


ref = logits(x0[:1])[0]
print("30-layer stack: row 0's logits vs M=1: max |diff| / argmax changed / |top1-top2| of M=1 =", f"{float((ref.topk(2).values[0]-ref.topk(2).values[1])):.4f}")
for m in Ms[1:]:
    y = logits(x0[:m])[0]
    print(f"  M={m:<4} max|dlogit|={float((y - ref).abs().max()):.4f}  argmax same: {bool(y.argmax() == ref.argmax())}", flush=True)
