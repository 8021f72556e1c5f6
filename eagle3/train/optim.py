"""The draft's optimizer: AdamW, or Muon on the hidden matrices with AdamW on the rest.

`train.optimizer='muon'` follows speculators 0.9's default (speculators.train.optimizers): Muon
orthogonalizes the updates of the 2D hidden matrices (fc, attention, MLP) with its learning rate matched to
AdamW's update RMS (`adjust_lr_fn='match_rms_adamw'`), so one learning rate and one schedule serve both;
the vocabulary-sized lm_head and the norms stay on AdamW, as in Keller Jordan's Muon.

BatchedMuon is torch.optim.Muon with one change: the Newton-Schulz iterations of all matrices of one shape
(a transposed one counts as that shape) run as one batched product over [n, rows, cols] instead of one
matrix after another. The update rule, bf16 arithmetic, state ('momentum_buffer' per parameter) and state
dict are torch's, so checkpoints written with torch.optim.Muon load and resume.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

# Newton-Schulz quintic coefficients and steps: torch.optim.Muon's defaults (Keller Jordan's Muon)
_NS = (3.4445, -4.7750, 2.0315)
_NS_STEPS = 5
# 2D weights that stay on AdamW: the output head (a vocabulary matrix, not a hidden one).
_ADAMW_ONLY = ("lm_head",)
_BETAS = (0.9, 0.95)


class BatchedMuon(torch.optim.Muon):
    """torch.optim.Muon whose Newton-Schulz iterations run batched over the matrices of each shape.

    Same update as torch's `_single_tensor_muon`: momentum buffer B <- lerp(B, g, 1 - mu); Nesterov update
    lerp(g, B, mu); NS orthogonalization in bf16; decoupled weight decay p *= 1 - lr * wd; p -= lr' * O with
    lr' from `adjust_lr_fn`. Only the order of the matrix products differs (batched, not one by one).
    """

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("BatchedMuon.step takes no closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            updates = [_momentum_update(self.state[p], p.grad, group["momentum"], group["nesterov"]) for p in params]
            shapes: dict[tuple, list[int]] = {}  # (short side, long side, dtype, device) -> indices into params
            for i, u in enumerate(updates):
                shapes.setdefault((min(u.shape), max(u.shape), u.dtype, u.device), []).append(i)
            for indices in shapes.values():
                wide = [updates[i].mT if updates[i].shape[0] > updates[i].shape[1] else updates[i] for i in indices]
                ortho = newton_schulz(torch.stack(wide), group["ns_coefficients"], group["ns_steps"], group["eps"])
                for i, o in zip(indices, ortho.unbind(0), strict=True):  # o: [short, long] -> the parameter's shape
                    p = params[i]
                    o = o.mT if p.shape[0] > p.shape[1] else o
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(o, alpha=-_adjusted_lr(group["lr"], group["adjust_lr_fn"], p.shape))


def _momentum_update(state: dict, grad: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Update the parameter's momentum buffer (created at zero, as torch's Muon does) and return its update."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
    buf = state["momentum_buffer"]
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


@functools.cache
def _cpu_has_bf16() -> bool:
    from eagle3.capture.cpu_kernels import native_bf16, read_cpu_flags

    return native_bf16(read_cpu_flags())


def ns_dtype(device: torch.device) -> torch.dtype:
    """bf16, as torch.optim.Muon, on a GPU or a CPU with bf16 hardware; float32 on other CPUs, where torch's bf16
    matmuls are emulated: one [576, 1536] orthogonalization took 5.2 s in bf16 against 0.084 s in float32 on a 2-core
    AVX2 EPYC, which made the demo's Muon steps 25 s each (benchmarks/results/cpu-dtype-2026-12-05.txt)."""
    return torch.bfloat16 if device.type != "cpu" or _cpu_has_bf16() else torch.float32


def newton_schulz(updates: torch.Tensor, coefficients: tuple[float, float, float] = _NS, steps: int = _NS_STEPS,
                  eps: float = 1e-7) -> torch.Tensor:
    """Batched quintic Newton-Schulz orthogonalization in bf16 (float32 on CPUs without bf16 hardware: ns_dtype),
    as torch.optim.Muon does per matrix.

    updates: [n, rows, cols] with rows <= cols -> [n, rows, cols] in that dtype, each matrix scaled to Frobenius norm
    <= 1 first (so its spectral norm is too), then `steps` iterations X <- aX + (bXX^T + c(XX^T)^2)X.
    """
    a, b, c = coefficients
    x = updates.to(ns_dtype(updates.device))
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)  # [n, 1, 1] norms
    for _ in range(steps):
        gram = x @ x.mT  # [n, rows, rows]
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)  # [n, rows, cols]
    return x


def _adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's learning-rate adjustment for a [A, B] matrix."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1, rows / cols))
    return lr


class MuonWithAdamW:
    """Muon (BatchedMuon) over the hidden matrices and AdamW over the others, stepped as one optimizer.

    Offers what the trainer uses of an optimizer: `param_groups` (to set the learning rate each step),
    `step()`, and a state dict that checkpoints hold and `load_state_dict` restores.
    """

    def __init__(self, muon: BatchedMuon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self) -> list[dict]:
        return [*self.muon.param_groups, *self.adamw.param_groups]

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def build_optimizer(kind: str, names: Sequence[str], params: Sequence[torch.Tensor], learning_rate: float,
                    weight_decay: float, fused: bool) -> torch.optim.Optimizer | MuonWithAdamW:
    """The optimizer of `kind` ('adamw' | 'muon') over `params` (named `names`, the draft's parameter names).

    Norm weights never decay. With 'muon', the Muon group decays by 0.1 (speculators' and Moonlight's
    setting; what keeps orthogonalized updates from growing the weights) and the AdamW group by
    `weight_decay`.
    """
    norm = [n.endswith("norm.weight") for n in names]
    if kind == "adamw":
        return _adamw(params, norm, learning_rate, weight_decay, fused)
    if kind != "muon":
        raise ValueError(f"train.optimizer={kind!r}: expected 'adamw' or 'muon'")
    hidden = [p.ndim == 2 and min(p.shape) > 1 and not any(part in n for part in _ADAMW_ONLY)
              for n, p in zip(names, params, strict=True)]
    muon = BatchedMuon([p for p, h in zip(params, hidden, strict=True) if h], lr=learning_rate,
                       weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
    rest = [(p, is_norm) for p, h, is_norm in zip(params, hidden, norm, strict=True) if not h]
    return MuonWithAdamW(muon, _adamw([p for p, _ in rest], [n for _, n in rest], learning_rate, weight_decay, fused))


def _adamw(params: Sequence[torch.Tensor], norm: Sequence[bool], learning_rate: float, weight_decay: float,
           fused: bool) -> torch.optim.AdamW:
    """AdamW over `params`, decaying all but the norm weights (`norm[i]`) by `weight_decay`."""
    return torch.optim.AdamW([{"params": [p for p, n in zip(params, norm, strict=True) if not n], "weight_decay": weight_decay},
                              {"params": [p for p, n in zip(params, norm, strict=True) if n], "weight_decay": 0.0}],
                             lr=learning_rate, betas=_BETAS, fused=fused)
