"""Simulated acceptance: how many draft tokens the target would accept, on held-out states.

For every held-out row t where the target has just produced an assistant token x_{t+1}
(loss_mask[t+1]) and k more positions exist, the draft drafts k tokens as vLLM does
after row t: step j reads x_{t+1+j} (teacher forcing: the data is the target's own greedy
output) and proposes d_j = d2t-mapped argmax of its logits. The target accepts d_0, d_1,
... while d_j equals its greedy token at t+1+j, i.e. argmax over the FULL target vocabulary
of lm_head(norm(final state at t+1+j)).

    acceptance length = 1 + mean accepted per draft   (the bonus token counts 1)
    per_position[j]   = share of drafts with more than j tokens accepted

This is the number vLLM's spec-decode counters give (1 + accepted / drafts) when the
draft is served, up to numeric near-ties between the two implementations.

When the held-out samples name data sources (eagle3.data.conversations), the same figures are
also given per source (`AcceptanceReport.by_source`): each source's drafts, counted and walked
within its own samples, so the pooled figure is the drafts-weighted mean of the per-source ones.
`SourceFigures` puts them beside the served figures per source for the reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from eagle3.capture.store import Sample, StoreReader
from eagle3.data.conversations import UNLABELLED
from eagle3.draft.export import load_exported_draft
from eagle3.draft.model import Eagle3Draft, ttt_alignment
from eagle3.draft.target_head import TargetHead, target_logits
from eagle3.draft.vocab import VocabMapping

Progress = Callable[[int, int, int], None]  # (held-out samples scored, samples in all, their tokens so far)


class EvalConfig(BaseModel):
    """Settings of the evaluate stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_draft_tokens: int = Field(
        default=3, ge=1, description="Draft tokens per draft (k), as vLLM's num_speculative_tokens."
    )
    served: bool = Field(
        default=True, description="Also serve the target with the draft in vLLM (speculative decoding) on held-out "
        "prompts and read vLLM's own acceptance counters (eagle3.evaluate.served_eval); two target loads."
    )
    served_max_prompts: int = Field(default=64, ge=1, description="Held-out prompts the served evaluation generates from.")
    served_max_new_tokens: int = Field(default=64, ge=1, description="Greedy tokens generated per prompt when served.")
    served_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Dtype vLLM serves the target in ('auto': the checkpoint's)."
    )
    served_kv_cache_gib: float = Field(default=1.0, gt=0, description="KV-cache budget of the served engines (GiB).")
    near_tie_logprob_gap: float = Field(
        default=0.25, ge=0, description="A greedy output that differs from the run without speculation counts as a "
        "proven near-tie when, at the first difference, each run chose its own top token and has the other run's token "
        "within this many nats of it (eagle3.evaluate.served_eval; bf16 logits between 16 and 32 are 0.125 apart: 0.25 "
        "is two bf16 steps)."
    )
    served_concurrency: list[int] = Field(
        default_factory=list, description="Requests in flight at once to measure the served speed at, e.g. [1, 8, 32]: "
        "the prompts go in waves of that many (eagle3.evaluate.served_sweep). Empty: no sweep, one measurement."
    )
    served_k: list[int] = Field(
        default_factory=list, description="num_speculative_tokens values the served sweep tries, one engine load each "
        "(plus one without the draft). Empty: only num_draft_tokens. The sweep runs when either list is set."
    )

    @field_validator("served_concurrency", "served_k")
    @classmethod
    def _positive_and_distinct(cls, values: list[int], info: ValidationInfo) -> list[int]:
        bad = [v for v in values if v < 1]
        if bad:
            raise ValueError(f"eval.{info.field_name} has {bad[0]}; expected positive integers (at least 1)")
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(f"eval.{info.field_name} repeats {repeated[0]}; expected each value once")
        return values


@dataclass(frozen=True)
class AcceptanceReport:
    """Acceptance over every eligible held-out row, and over the rows a served run would visit."""

    acceptance_length: float  # 1 + mean accepted per draft, one draft per eligible row
    per_position: list[float]  # [j]: share of drafts with more than j tokens accepted
    num_drafts: int
    # The same drafts, but only at the rows a served greedy run drafts at (after a draft at
    # row t with a tokens accepted, the next one is at row t+a+1): what vLLM's counters show.
    served_acceptance_length: float = 1.0
    served_num_drafts: int = 0
    num_samples: int = 0  # held-out samples scored
    # the same figures per data source, when the samples name any (empty: they name none)
    by_source: dict[str, AcceptanceReport] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """acceptance.json's "simulated" block; "per_source" only when the samples name data sources."""
        out: dict[str, object] = {"acceptance_length": self.acceptance_length, "per_position": self.per_position,
                                  "num_drafts": self.num_drafts, "served_acceptance_length": self.served_acceptance_length,
                                  "served_num_drafts": self.served_num_drafts}
        if self.by_source:
            out["per_source"] = {name: r.to_dict() | {"num_samples": r.num_samples} for name, r in self.by_source.items()}
        return out

    def to_markdown(self) -> str:
        positions = range(1, len(self.per_position) + 1)
        header = "| draft position | " + " | ".join(str(j) for j in positions) + " |"
        rule = "|---|" + "---|" * len(self.per_position)
        row = "| accepted share | " + " | ".join(f"{p:.3f}" for p in self.per_position) + " |"
        return (
            f"**Simulated acceptance length: {self.acceptance_length:.3f}** "
            f"({self.num_drafts} drafts of {len(self.per_position)} tokens; "
            f"{self.served_acceptance_length:.3f} over the {self.served_num_drafts} drafts a served run makes)"
            f"\n\n{header}\n{rule}\n{row}\n"
        )


def accepted_counts(draft_tokens: torch.Tensor, target_greedy: torch.Tensor) -> torch.Tensor:
    """Tokens accepted per draft: the length of the leading run of matches.

    draft_tokens [K, N] (target ids proposed by each of N drafts), target_greedy [K, N]
    (the target's greedy token at the same positions) -> int64 [N] in 0..K.
    """
    matches = (draft_tokens == target_greedy).to(torch.int64)  # [K, N]
    return torch.cumprod(matches, dim=0).sum(dim=0)  # [N]


def served_walk(rows: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """Pick the drafts a served run makes. rows [N] increasing, accepted [N] -> bool [N].

    The first eligible row drafts; after a draft at row t with a accepted, the target has
    produced a+1 tokens, so the next draft is at the first eligible row >= t+a+1.
    """
    chosen = torch.zeros(rows.shape[0], dtype=torch.bool)
    next_row = -1
    for i, (row, count) in enumerate(zip(rows.tolist(), accepted.tolist(), strict=True)):
        if row >= next_row:
            chosen[i] = True
            next_row = row + count + 1
    return chosen


def report_from_counts(accepted: torch.Tensor, served: torch.Tensor, num_draft_tokens: int,
                       num_samples: int = 0) -> AcceptanceReport:
    """accepted int64 [N], served bool [N] -> AcceptanceReport (no drafts: length 1, zeros)."""
    num = int(accepted.shape[0])
    if num == 0:
        return AcceptanceReport(acceptance_length=1.0, per_position=[0.0] * num_draft_tokens, num_drafts=0,
                                num_samples=num_samples)
    per_position = [float((accepted > j).double().mean()) for j in range(num_draft_tokens)]
    return AcceptanceReport(
        acceptance_length=1.0 + float(accepted.double().mean()),
        per_position=per_position,
        num_drafts=num,
        served_acceptance_length=1.0 + float(accepted[served].double().mean()),
        served_num_drafts=int(served.sum()),
        num_samples=num_samples,
    )


def report_by_source(per_sample: list[tuple[str | None, torch.Tensor, torch.Tensor]],
                     num_draft_tokens: int) -> AcceptanceReport:
    """Each sample's (data source, accepted int64 [N_i], served bool [N_i]) -> the pooled report, with `by_source`
    filled when any sample names a source (samples without one are grouped as UNLABELLED)."""
    def pooled(rows: list[tuple[str | None, torch.Tensor, torch.Tensor]]) -> AcceptanceReport:
        accepted = torch.cat([torch.zeros(0, dtype=torch.int64)] + [a for _, a, _ in rows])  # [sum N_i]
        served = torch.cat([torch.zeros(0, dtype=torch.bool)] + [w for _, _, w in rows])  # [sum N_i]
        return report_from_counts(accepted, served, num_draft_tokens, num_samples=len(rows))

    report = pooled(per_sample)
    if all(source is None for source, _, _ in per_sample):
        return report
    names = sorted({source or UNLABELLED for source, _, _ in per_sample})
    by_source = {name: pooled([row for row in per_sample if (row[0] or UNLABELLED) == name]) for name in names}
    return replace(report, by_source=by_source)


@dataclass(frozen=True)
class SourceFigures:
    """One data source's figures for the reports: simulated, the served-positions walk, and served by vLLM."""

    source: str
    samples: int
    drafts: int
    simulated: float
    walk: float
    served: float | None = None  # None: the served evaluation did not run, or vLLM gave no per-request counters
    served_drafts: int = 0

    @classmethod
    def from_payload(cls, payload: dict) -> list[SourceFigures]:
        """The per-source figures of an acceptance.json payload (empty when its samples name no source)."""
        simulated = (payload.get("simulated") or {}).get("per_source") or {}
        served = (payload.get("served") or {}).get("per_source") or {}
        return [cls(name, int(block.get("num_samples", 0)), int(block["num_drafts"]), float(block["acceptance_length"]),
                    float(block["served_acceptance_length"]),
                    float(served[name]["acceptance_length"]) if name in served else None,
                    int(served[name]["num_drafts"]) if name in served else 0)
                for name, block in simulated.items()]

    @staticmethod
    def markdown(rows: list[SourceFigures]) -> str:
        """A table, one row per source ('' when there is none)."""
        if not rows:
            return ""
        lines = ["| data source | held-out samples | drafts | simulated | walk | served (vLLM) | served drafts |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            served = f"{r.served:.3f}" if r.served is not None else "not run"
            name = r.source.replace("|", "\\|")
            lines.append(f"| {name} | {r.samples} | {r.drafts} | {r.simulated:.3f} | {r.walk:.3f} | {served} | "
                         f"{r.served_drafts if r.served is not None else ''} |")
        return "\n".join(lines) + "\n"


@torch.no_grad()
def sample_accepted(
    model: Eagle3Draft, mapping: VocabMapping, head: TargetHead, sample: Sample, num_draft_tokens: int,
    greedy_cache: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eligible rows of one sample and the tokens accepted at each: (int64 [N], int64 [N]).

    `greedy_cache` (sample id -> the target's greedy tokens [T]) saves recomputing what does not
    depend on the draft when the same held-out samples score many checkpoints (the target's
    full-vocabulary logits were over half of a scoring's CPU time)."""
    k, length = num_draft_tokens, sample.num_tokens
    n_aux = sample.hidden_states.shape[1] - 1
    device = next(model.parameters()).device
    states = sample.hidden_states.to(device=device, dtype=torch.float32)  # [T, n_aux+1, H]
    step_tokens, target_pos, _ = ttt_alignment(sample.input_ids, sample.loss_mask, k)  # [K, T] each
    positions = torch.arange(length, device=device)  # [T]
    drafts = [  # doc_ids None: the rows are one document
        logits.argmax(-1) for logits in model.unroll(states[:, :n_aux], step_tokens.to(device), positions, None, head.embed)
    ]  # K x [T] draft ids
    draft_ids = torch.stack(drafts).cpu()  # [K, T]
    draft_tokens = draft_ids + mapping.d2t[draft_ids]  # [K, T] target ids
    greedy = None if greedy_cache is None else greedy_cache.get(sample.sample_id)
    if greedy is None:
        greedy = target_logits(head, states[:, -1]).argmax(-1).cpu()  # [T] over the full vocabulary
        if greedy_cache is not None:
            greedy_cache[sample.sample_id] = greedy
    rows = torch.arange(length)
    mask = sample.loss_mask.to(torch.bool)
    # Rows right after the target produced an assistant token, with k positions left to verify.
    usable = (rows + k <= length - 1) & mask[(rows + 1).clamp(max=length - 1)]  # [T]
    return rows[usable], accepted_counts(draft_tokens[:, usable], greedy[target_pos[:, usable]])  # [N], [N]


def simulate_acceptance(
    draft: Path | tuple[Eagle3Draft, VocabMapping],
    heldout_store_dir: Path,
    target_head: TargetHead,
    num_draft_tokens: int = 3,
    greedy_cache: dict[str, torch.Tensor] | None = None,
    verify: bool = True,
    progress: Progress | None = None,
) -> AcceptanceReport:
    """Acceptance of `draft` (an exported folder, or a model and its mapping) on a held-out store.
    `greedy_cache`: see sample_accepted (pass the same dict for every checkpoint of one run).
    `verify=False`: the caller has already checked the store's shards against their sha256.
    `progress`: called after each sample."""
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens is {num_draft_tokens}; expected at least 1 (evaluate.num_draft_tokens)")
    if isinstance(draft, tuple):
        model, mapping = draft
    else:
        model, mapping = load_exported_draft(Path(draft))
        if torch.cuda.is_available():
            model.cuda()
    if mapping.target_vocab_size != target_head.vocab_size:
        raise ValueError(
            f"the draft maps a vocabulary of {mapping.target_vocab_size}, the target head has {target_head.vocab_size}"
        )
    device = next(model.parameters()).device
    head = target_head.to(torch.float32, device)
    was_training = model.training
    model.eval()
    per_sample: list[tuple[str | None, torch.Tensor, torch.Tensor]] = []  # (source, accepted [N_i], walked [N_i])
    reader = StoreReader(heldout_store_dir, verify=verify)
    scored = 0  # tokens
    try:
        for index, sample in enumerate(reader, start=1):
            rows, counts = sample_accepted(model, mapping, head, sample, num_draft_tokens, greedy_cache)
            per_sample.append((sample.source, counts, served_walk(rows, counts)))  # the walk stays within a sample
            scored += sample.num_tokens
            if progress is not None:
                progress(index, len(reader), scored)
    finally:
        model.train(was_training)
    return report_by_source(per_sample, num_draft_tokens)
