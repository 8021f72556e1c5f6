"""Served acceptance: vLLM itself runs speculative decoding with the exported draft.

This is the number users see in production. The target is loaded in vLLM with
`speculative_config={"method": "eagle3", "model": <export dir>, "num_speculative_tokens": k}`,
generates greedily from held-out prompts, and vLLM's own counters give

    acceptance length = 1 + accepted tokens / drafts
    per_position[j]   = accepted tokens at draft position j / drafts

Then the same target is loaded WITHOUT the draft (the first engine is released before) and
generates from the same prompts. Speculative decoding must not change greedy output: the
share of identical outputs is reported, and every output that differs is checked at its
first differing token. A difference is a near-tie when the speculative run's token is the
reference run's runner-up and its logprob is within `near_tie_gap` of the top token's: the
two engines ran different batch shapes (k+1 tokens verified at once), so the logits differ
by rounding, and where the top two are that close rounding alone picks either.

A prompt is the part of a held-out sample before its first loss-masked (assistant) token:
the chat up to and including the assistant header, which is what a user sends.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagle3.capture import vllm_adapter


@dataclass(frozen=True)
class Divergence:
    """Where a speculative output first differs from the reference output of the same prompt."""

    prompt_index: int
    position: int  # index among the generated tokens
    spec_token: int | None  # None: the speculative output ended here
    ref_token: int | None  # None: the reference output ended here
    logprob_gap: float | None  # reference logprob(ref_token) - logprob(spec_token); None if not in its top-n

    def is_near_tie(self, near_tie_gap: float) -> bool:
        return self.logprob_gap is not None and self.logprob_gap <= near_tie_gap


@dataclass(frozen=True)
class ServedReport:
    """Served speculative decoding: vLLM's counters and the comparison with plain greedy decoding."""

    acceptance_length: float
    per_position: list[float]
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_prompts: int
    identical: int
    near_tie_gap: float
    divergences: list[Divergence] = field(default_factory=list)
    generated_tokens: int = 0
    seconds_speculative: float = 0.0
    seconds_reference: float = 0.0

    @property
    def identical_share(self) -> float:
        return self.identical / self.num_prompts if self.num_prompts else 0.0

    @property
    def near_ties(self) -> int:
        return sum(d.is_near_tie(self.near_tie_gap) for d in self.divergences)

    def to_dict(self) -> dict[str, object]:
        return asdict(self) | {"identical_share": self.identical_share, "near_ties": self.near_ties}

    def to_markdown(self) -> str:
        positions = range(1, len(self.per_position) + 1)
        header = "| draft position | " + " | ".join(str(j) for j in positions) + " |"
        rule = "|---|" + "---|" * len(self.per_position)
        row = "| accepted share | " + " | ".join(f"{p:.3f}" for p in self.per_position) + " |"
        unexplained = len(self.divergences) - self.near_ties
        gaps = [f"{d.logprob_gap:.3f}" if d.logprob_gap is not None else "not in top 2" for d in self.divergences]
        speed = ""
        if self.seconds_speculative > 0 and self.seconds_reference > 0:
            speed = f"; wall time {self.seconds_speculative:.1f} s with the draft, {self.seconds_reference:.1f} s without"
        return (
            f"**Served acceptance length (vLLM's counters): {self.acceptance_length:.3f}** "
            f"({self.num_drafts} drafts of {len(self.per_position)} tokens over {self.num_prompts} prompts{speed})\n\n"
            f"{header}\n{rule}\n{row}\n\n"
            f"Greedy output identical to the run without speculation: {self.identical}/{self.num_prompts} "
            f"({self.identical_share:.1%}); of the {len(self.divergences)} that differ, {self.near_ties} are near-ties "
            f"(runner-up within {self.near_tie_gap} nats at the first differing token), {unexplained} are not"
            + (f"; gaps: {', '.join(gaps)}" if gaps else "") + ".\n"
        )


def heldout_prompts(samples: Iterable[tuple[Sequence[int], Sequence[int]]], max_prompts: int, max_len: int) -> list[list[int]]:
    """Prompts of held-out samples: (input_ids, loss_mask) pairs -> the tokens before the first masked one.

    Samples without an assistant token, with no prompt before it, or with a prompt longer
    than `max_len` are skipped. At most `max_prompts`, in sample order.
    """
    prompts = []
    for input_ids, loss_mask in samples:
        first = next((i for i, m in enumerate(loss_mask) if m), None)
        if first is None or first == 0 or first > max_len:
            continue
        prompts.append([int(t) for t in input_ids[:first]])
        if len(prompts) == max_prompts:
            break
    return prompts


def first_divergence(index: int, spec: vllm_adapter.GreedyOutput, ref: vllm_adapter.GreedyOutput) -> Divergence | None:
    """None when both outputs are the same tokens; else where and how they first differ."""
    if spec.token_ids == ref.token_ids:
        return None
    position = next(
        (i for i, (a, b) in enumerate(zip(spec.token_ids, ref.token_ids, strict=False)) if a != b),
        min(len(spec.token_ids), len(ref.token_ids)),
    )
    spec_token = spec.token_ids[position] if position < len(spec.token_ids) else None
    ref_token = ref.token_ids[position] if position < len(ref.token_ids) else None
    gap = None
    tops = ref.top_logprobs[position] if position < len(ref.top_logprobs) else {}
    if spec_token is not None and ref_token is not None and spec_token in tops and ref_token in tops:
        gap = tops[ref_token] - tops[spec_token]
    return Divergence(index, position, spec_token, ref_token, gap)


def served_acceptance(
    target_dir: Path,
    export_dir: Path,
    prompts: list[list[int]],
    *,
    num_draft_tokens: int,
    max_new_tokens: int,
    dtype: str = "auto",
    kv_cache_gib: float = 1.0,
    near_tie_gap: float = 0.25,
) -> ServedReport:
    """Serve the target with and without the draft on `prompts` (greedy) and compare; see the module docstring."""
    if not prompts:
        raise ValueError("no held-out prompts to serve; raise data.heldout_fraction or evaluate.served_max_prompts")
    max_model_len = max(len(p) for p in prompts) + max_new_tokens + num_draft_tokens + 1
    settings = dict(dtype=dtype, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib)
    vllm_adapter.release_all()  # one engine in memory at a time
    llm = vllm_adapter.load_serving_engine(
        str(target_dir), **settings, speculative_dir=str(export_dir), num_speculative_tokens=num_draft_tokens
    )
    try:
        before = vllm_adapter.spec_decode_counters(llm)
        started = time.monotonic()
        spec = vllm_adapter.greedy_generate(llm, prompts, max_new_tokens=max_new_tokens, num_logprobs=0)
        seconds_spec = time.monotonic() - started
        counters = vllm_adapter.spec_decode_counters(llm).minus(before)
    finally:
        vllm_adapter.shutdown_engine(llm)
        del llm
    llm = vllm_adapter.load_serving_engine(str(target_dir), **settings)
    try:
        started = time.monotonic()
        ref = vllm_adapter.greedy_generate(llm, prompts, max_new_tokens=max_new_tokens, num_logprobs=2)
        seconds_ref = time.monotonic() - started
    finally:
        vllm_adapter.shutdown_engine(llm)
        del llm
    return build_report(counters, spec, ref, num_draft_tokens, near_tie_gap, seconds_spec, seconds_ref)


def build_report(
    counters: vllm_adapter.SpecDecodeCounters,
    spec: list[vllm_adapter.GreedyOutput],
    ref: list[vllm_adapter.GreedyOutput],
    num_draft_tokens: int,
    near_tie_gap: float,
    seconds_spec: float = 0.0,
    seconds_ref: float = 0.0,
) -> ServedReport:
    """Turn counters and the two runs' outputs into a ServedReport (pure)."""
    drafts = counters.drafts
    per_pos = list(counters.accepted_per_position) + [0] * (num_draft_tokens - len(counters.accepted_per_position))
    divergences = [d for i, (s, r) in enumerate(zip(spec, ref, strict=True)) if (d := first_divergence(i, s, r))]
    return ServedReport(
        acceptance_length=1.0 + counters.accepted_tokens / drafts if drafts else 1.0,
        per_position=[a / drafts if drafts else 0.0 for a in per_pos[:num_draft_tokens]],
        num_drafts=drafts,
        num_draft_tokens=counters.draft_tokens,
        num_accepted_tokens=counters.accepted_tokens,
        num_prompts=len(ref),
        identical=len(ref) - len(divergences),
        near_tie_gap=near_tie_gap,
        divergences=divergences,
        generated_tokens=sum(len(o.token_ids) for o in spec),
        seconds_speculative=seconds_spec,
        seconds_reference=seconds_ref,
    )
