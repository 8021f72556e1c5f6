"""The draft's training loss: KL(target || draft) over the draft vocabulary, per TTT step.

For every TTT step j (see eagle3.draft.model for the alignment), the target distribution is softmax
over the draft vocabulary of the target's own logits lm_head(norm(final state)) gathered at
the draft vocabulary's target ids. Each row is weighted by the loss mask of the token it
predicts; a step's loss is the weighted mean over rows, the total is the mean over steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from eagle3.draft.batches import MicroBatch
from eagle3.draft.model import Eagle3Draft
from eagle3.draft.target_head import TargetHead, target_logits


def kl_loss(draft_logits: torch.Tensor, target_logp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted mean over rows of KL(target || draft). [L, Vd], [L, Vd], [L] -> scalar. The definition;
    training computes the same with `fused_kl_loss`."""
    draft_logq = F.log_softmax(draft_logits.float(), dim=-1)  # [L, Vd]
    kl = (target_logp.exp() * (target_logp - draft_logq)).sum(-1)  # [L]
    return (kl * weights).sum() / weights.sum().clamp_min(1.0)


class _FusedKL(torch.autograd.Function):
    """kl_loss with few passes over the [L, Vd] logits: KL = sum p log p - sum p log q, where the
    first term is precomputed per target row, and the gradient (softmax(z) - p) * w / sum(w) is
    written in place. About a third of the memory traffic of the composed eager version."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor, neg_entropy: torch.Tensor, weights: torch.Tensor):  # noqa: ANN001, ANN205
        with torch.autocast(logits.device.type, enabled=False):
            logq = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [L, Vd]
            cross = torch.bmm(probs[:, None, :], logq[:, :, None]).view(-1)  # [L]: sum_v p log q
            denom = weights.sum().clamp_min(1.0)
            ctx.save_for_backward(logq, probs, weights, denom)
            ctx.logits_dtype = logits.dtype
            return ((neg_entropy - cross) * weights).sum() / denom

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        logq, probs, weights, denom = ctx.saved_tensors
        out = logq.exp_()  # softmax(z), in place: logq is not needed again
        out.sub_(probs).mul_((weights * (grad / denom))[:, None])  # [L, Vd]
        return out.to(ctx.logits_dtype), None, None, None


def fused_kl_loss(logits: torch.Tensor, probs: torch.Tensor, neg_entropy: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """kl_loss(logits, log(probs), weights) given probs [L, Vd] (fp32, rows sum to 1) and
    neg_entropy [L] = sum_v p log p: logits [L, Vd] -> scalar."""
    return _FusedKL.apply(logits, probs, neg_entropy, weights)


def target_distribution(head: TargetHead, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution over the draft vocabulary: final [L, H] -> probs [L, Vd] (fp32) and
    neg_entropy [L] = sum_v p log p. No gradient flows into it."""
    with torch.no_grad():
        target_logp = F.log_softmax(target_logits(head, final).float(), dim=-1)  # [L, Vd]
        probs = target_logp.exp()  # [L, Vd]
        return probs, (probs * target_logp).sum(-1)


def plain_kl_loss(logits: torch.Tensor, probs: torch.Tensor, neg_entropy: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """fused_kl_loss as plain differentiable ops: what torch.compile turns into two fused kernels (a
    log-softmax-and-cross reduction forward, one elementwise pass backward), where eager would keep
    several [L, Vd] fp32 temporaries."""
    cross = (probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)  # [L]
    return ((neg_entropy - cross) * weights).sum() / weights.sum().clamp_min(1.0)


class LossKernels(NamedTuple):
    """How batch_loss computes the target distribution and the per-step KL: eagerly (EAGER), or
    compiled (`compiled_kernels`, train.compile). Both compute the same values up to rounding."""

    target: Callable[[TargetHead, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    kl: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


EAGER = LossKernels(target_distribution, fused_kl_loss)


def compiled_kernels() -> LossKernels:
    """torch.compile'd loss kernels (the KL's [L, Vd] passes fused; shapes marked dynamic as rows vary)."""
    return LossKernels(torch.compile(target_distribution, dynamic=True), torch.compile(plain_kl_loss, dynamic=True))


def add_feature_noise(aux: torch.Tensor, scale: float, generator: torch.Generator) -> torch.Tensor:
    """`aux` [..., H] plus Gaussian noise whose standard deviation is `scale` times each state's RMS
    (train.feature_noise), drawn from `generator` in float32 on aux's device."""
    states = aux.float()
    rms = states.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(states.shape, generator=generator, device=aux.device, dtype=torch.float32)
    return (states + noise * (rms * scale)).to(aux.dtype)


def batch_loss(
    model: Eagle3Draft, batch: MicroBatch, head: TargetHead, one_doc: bool = False, kernels: LossKernels = EAGER,
    decay: float = 1.0, noise: tuple[float, torch.Generator] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss of one micro-batch and its per-step losses: the mean over TTT steps, or with `decay` < 1 the
    mean weighted by decay**step (train.ttt_loss_decay).

    `head.lm_head` holds only the draft vocabulary's rows of the target's; its dtype is the
    compute dtype. `one_doc`: the batch is one sample (plain causal attention). `noise`: (scale, generator)
    perturbs the aux states the draft reads (add_feature_noise), never the final state its targets come from.
    """
    aux, final = batch.split_states(head.embed.dtype)  # [L, n_aux, H], [L, H]
    if noise is not None:
        aux = add_feature_noise(aux, *noise)
    probs, neg_entropy = kernels.target(head, final)  # [L, Vd], [L]
    per_step = []
    drafts = model.unroll(aux, batch.step_tokens, batch.positions, None if one_doc else batch.doc_ids, head.embed)
    for step, draft_logits in enumerate(drafts):  # draft_logits [L, Vd]
        rows = batch.num_tokens - 1 - step  # row r reads the target at r+1+step (see MicroBatch)
        if rows <= 0:
            per_step.append(draft_logits.sum() * 0.0)
            continue
        per_step.append(kernels.kl(draft_logits[:rows], probs[1 + step :], neg_entropy[1 + step :],
                                   batch.weights[step, :rows]))
    if decay == 1.0:
        return torch.stack(per_step).mean(), per_step
    weights = [decay**step for step in range(len(per_step))]
    return sum(w * x for w, x in zip(weights, per_step, strict=True)) / sum(weights), per_step
