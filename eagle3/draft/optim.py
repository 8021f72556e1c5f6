"""The draft's optimizer: AdamW, or Muon on the hidden matrices with AdamW on the rest.

`train.optimizer='muon'` follows speculators 0.9's default (speculators.train.optimizers): torch.optim.Muon
orthogonalizes the updates of the 2D hidden matrices (fc, attention, MLP) with its learning rate matched to
AdamW's update RMS (`adjust_lr_fn='match_rms_adamw'`), so one learning rate and one schedule serve both;
the vocabulary-sized lm_head and the norms stay on AdamW, as in Keller Jordan's Muon.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# 2D weights that stay on AdamW: the output head (a vocabulary matrix, not a hidden one).
_ADAMW_ONLY = ("lm_head",)
_BETAS = (0.9, 0.95)


class MuonWithAdamW:
    """Torch's Muon over the hidden matrices and AdamW over the others, stepped as one optimizer.

    Offers what the trainer uses of an optimizer: `param_groups` (to set the learning rate each step),
    `step()`, and a state dict that checkpoints hold and `load_state_dict` restores.
    """

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
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
    muon = torch.optim.Muon([p for p, h in zip(params, hidden, strict=True) if h], lr=learning_rate,
                            weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
    rest = [(p, is_norm) for p, h, is_norm in zip(params, hidden, norm, strict=True) if not h]
    return MuonWithAdamW(muon, _adamw([p for p, _ in rest], [n for _, n in rest], learning_rate, weight_decay, fused))


def _adamw(params: Sequence[torch.Tensor], norm: Sequence[bool], learning_rate: float, weight_decay: float,
           fused: bool) -> torch.optim.AdamW:
    """AdamW over `params`, decaying all but the norm weights (`norm[i]`) by `weight_decay`."""
    return torch.optim.AdamW([{"params": [p for p, n in zip(params, norm, strict=True) if not n], "weight_decay": weight_decay},
                              {"params": [p for p, n in zip(params, norm, strict=True) if n], "weight_decay": 0.0}],
                             lr=learning_rate, betas=_BETAS, fused=fused)
