"""Served acceptance: vLLM itself runs speculative decoding with the exported draft.

This is the number users see in production. The target is loaded in vLLM with
`speculative_config={"method": "eagle3", "model": <export dir>, "num_speculative_tokens": k}`,
generates greedily from held-out prompts, and vLLM's own counters give

    acceptance length = 1 + accepted tokens / drafts
    per_position[j]   = accepted tokens at draft position j / drafts

Then the same target is loaded WITHOUT the draft (the first engine is released before) and
generates from the same prompts with the same settings. Speculative decoding must not change
greedy output: the share of identical outputs is reported, and every output that differs is
examined at its first differing token, where both runs had seen the same tokens. Both runs
ask vLLM for the top `TOP_LOGPROBS` logprobs of each generated token, so at that position each
run's own distribution ranks both candidate tokens (the speculative run's logprobs are the
target's, from its verify pass).

A difference is a *proven near-tie* (`Divergence.is_near_tie`) when, at that position,
  1. each run's token is its own top-ranked token (greedy; verification must give this), and
  2. each run ranks the other run's token within `near_tie_gap` nats below its own:
     0 <= ref_lp(ref_token) - ref_lp(spec_token) <= gap and 0 <= spec_lp(spec_token) - spec_lp(ref_token) <= gap.
The target itself then scored the two tokens a hair apart, and the two runs' scores differ by
no more than the rounding that kernels of different batch shapes make (a verify pass scores
k+1 tokens per request at once, plain decoding one, and the two runs batch the prompts
differently); `gap_drift` measures that rounding where the runs agree. Anything else -- a token
outside the other run's top-n, a larger gap in either run, a token a run chose that is not its
own top, an output that ended first -- is *unexplained*. Why the margin (default 0.25 nats): a
logprob gap is a logit difference, and vLLM's logits leave a bf16 model in bf16, on a grid of
0.125 for logits in [16, 32) (SmolLM2's top logits: median 25.5, 5-95% 14.7-35.3); 0.25 is two
such steps. In float32 the two runs' gaps agree to about 1e-4 nats.

A prompt is the part of a held-out sample before its first loss-masked (assistant) token:
the chat up to and including the assistant header, which is what a user sends. A prompt that held
images is sent with them (`multi_modal_data`, as prepared: one placeholder per image, which the
server's own multimodal processor expands), so the draft is served the tokens after an image as the
server sees them; `ServedReport.prompt_tokens` counts the prompts' tokens as vLLM ran them.

When the prompts' samples name data sources, `ServedReport.per_source` gives the served
acceptance per source from vLLM's per-request counters: 1 + the source's accepted draft
tokens / its drafts, pooled over its requests as vLLM pools over all of them. A vLLM that
gives no per-request counters gives no per-source served figure (the report says so).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from eagle3.capture import vllm_adapter, vllm_serving
from eagle3.data.conversations import UNLABELLED, TokenizedSample


# vLLM's default `max_logprobs`: the most a request may ask for from an engine loaded without raising it.
TOP_LOGPROBS = 20


def rank_of(token: int | None, tops: dict[int, float]) -> int | None:
    """1 + how many tokens of `tops` (token -> logprob) score strictly higher; None when not in `tops`."""
    if token is None or token not in tops:
        return None
    return 1 + sum(lp > tops[token] for lp in tops.values())


@dataclass(frozen=True)
class RunView:
    """One run's distribution at a first differing position, seen through the two candidate tokens."""

    own_rank: int | None  # rank of the token this run chose (1: its top; None: not in its top-n)
    other_rank: int | None  # rank of the other run's token (None: not in this run's top-n, or that run had ended)
    gap: float | None  # logprob(own token) - logprob(other token) in this run; None unless both are in its top-n

    @classmethod
    def of(cls, own: int | None, other: int | None, tops: dict[int, float]) -> RunView:
        both = own is not None and other is not None and own in tops and other in tops
        return cls(rank_of(own, tops), rank_of(other, tops), tops[own] - tops[other] if both else None)


@dataclass(frozen=True)
class Divergence:
    """Where a speculative output first differs from the reference output of the same prompt, and each run's view there."""

    prompt_index: int
    position: int  # index among the generated tokens
    spec_token: int | None  # None: the speculative output ended here
    ref_token: int | None  # None: the reference output ended here
    ref_view: RunView  # the reference run (no draft): own = ref_token, other = spec_token
    spec_view: RunView  # the speculative run (target's verify pass): own = spec_token, other = ref_token

    @property
    def logprob_gap(self) -> float | None:
        """Reference logprob(ref_token) - logprob(spec_token); None if either is outside its top-n."""
        return self.ref_view.gap

    def is_near_tie(self, near_tie_gap: float) -> bool:
        """Proven near-tie (module docstring): each run chose its own top token, the other's within `near_tie_gap` nats."""
        views = (self.ref_view, self.spec_view)
        return all(v.own_rank == 1 and v.gap is not None and 0.0 <= v.gap <= near_tie_gap for v in views)


def gap_drift(spec: vllm_serving.GreedyOutput, ref: vllm_serving.GreedyOutput, upto: int) -> list[float]:
    """Rounding between the runs where they agree: at each position < `upto` (same tokens so far, same token chosen),
    |change of the reference's top-1 minus runner-up logprob gap| from the reference run to the speculative one."""
    drift = []
    for i in range(min(upto, len(spec.top_logprobs), len(ref.top_logprobs))):
        r, s, top = ref.top_logprobs[i], spec.top_logprobs[i], ref.token_ids[i]
        second = max((t for t in r if t != top), key=r.__getitem__, default=None)
        if second is not None and top in s and second in s:
            drift.append(abs((r[top] - r[second]) - (s[top] - s[second])))
    return drift


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
    top_logprobs: int = TOP_LOGPROBS
    agree_positions: int = 0  # positions where gap_drift was measured
    agree_drift_max: float = 0.0  # its largest value (nats)
    agree_drift_p99: float = 0.0  # its 99th percentile (nats)
    agree_drift_nonzero: int = 0  # positions where it is not 0: the two engines' logits differed there at all
    # each request's own drafts and accepted draft tokens (vLLM's per-request metrics), in prompt order; empty when
    # vLLM gave none. Summed, they are the pooled counters above.
    request_drafts: list[int] = field(default_factory=list)
    request_accepted: list[int] = field(default_factory=list)
    reference_tokens: int = 0  # tokens the run without the draft generated (generated_tokens: with it)
    request_sources: list[str | None] = field(default_factory=list)  # each prompt's data source; empty: none named
    prompt_tokens: int = 0  # the prompts' tokens as vLLM ran them (images expanded), in the run without the draft
    prompts_with_images: int = 0  # prompts sent with their images
    # how each engine ran, read from its config after the load: [with the draft, without it] (empty: not recorded)
    engines: list[vllm_serving.EngineMode] = field(default_factory=list)

    @property
    def per_source(self) -> dict[str, dict[str, float | int]]:
        """Data source -> {acceptance_length, num_drafts, num_accepted_tokens, requests}, pooled over the source's
        requests; empty when the prompts name no source or vLLM gave no per-request counters."""
        if not self.request_sources or not any(self.request_sources) or not self.request_drafts:
            return {}
        out: dict[str, dict[str, float | int]] = {}
        for name in sorted({s or UNLABELLED for s in self.request_sources}):
            picked = [i for i, s in enumerate(self.request_sources) if (s or UNLABELLED) == name]
            drafts = sum(self.request_drafts[i] for i in picked)
            accepted = sum(self.request_accepted[i] for i in picked)
            out[name] = {"acceptance_length": 1.0 + accepted / drafts if drafts else 1.0, "num_drafts": drafts,
                         "num_accepted_tokens": accepted, "requests": len(picked)}
        return out

    @property
    def request_acceptance(self) -> list[float]:
        """Each request's own acceptance length, 1 + its accepted / its drafts, for the requests that drafted."""
        return [1.0 + a / d for d, a in zip(self.request_drafts, self.request_accepted, strict=True) if d]

    @property
    def request_mean_acceptance_length(self) -> float | None:
        """The mean over requests of each one's acceptance length: short requests weigh as much as long ones."""
        lengths = self.request_acceptance
        return sum(lengths) / len(lengths) if lengths else None

    @property
    def tokens_per_second(self) -> tuple[float, float] | None:
        """(with the draft, without it): generated tokens over generation seconds, loads excluded."""
        if self.seconds_speculative <= 0 or self.seconds_reference <= 0:
            return None
        return self.generated_tokens / self.seconds_speculative, self.reference_tokens / self.seconds_reference

    @property
    def speedup(self) -> float | None:
        """Tokens/s with the draft over tokens/s without: above 1 the draft makes serving faster."""
        rates = self.tokens_per_second
        return rates[0] / rates[1] if rates and rates[1] > 0 else None

    @property
    def identical_share(self) -> float:
        return self.identical / self.num_prompts if self.num_prompts else 0.0

    @property
    def near_ties(self) -> int:
        return sum(d.is_near_tie(self.near_tie_gap) for d in self.divergences)

    @property
    def identical_share_outside_near_ties(self) -> float:
        """Identical outputs among the prompts whose difference is not a proven near-tie (1.0: speculation changed nothing else)."""
        judged = self.num_prompts - self.near_ties
        return self.identical / judged if judged else 1.0

    def to_dict(self) -> dict[str, object]:
        return asdict(self) | {"per_source": self.per_source,
                               "request_mean_acceptance_length": self.request_mean_acceptance_length,
                               "speedup": self.speedup, "tokens_per_second": self.tokens_per_second,
                               "identical_share": self.identical_share, "near_ties": self.near_ties,
                               "identical_share_outside_near_ties": self.identical_share_outside_near_ties,
                               "near_tie": [d.is_near_tie(self.near_tie_gap) for d in self.divergences]}

    def to_markdown(self) -> str:
        positions = range(1, len(self.per_position) + 1)
        header = "| draft position | " + " | ".join(str(j) for j in positions) + " |"
        rule = "|---|" + "---|" * len(self.per_position)
        row = "| accepted share | " + " | ".join(f"{p:.3f}" for p in self.per_position) + " |"
        unexplained = len(self.divergences) - self.near_ties
        text = (
            f"**Served acceptance length (vLLM's counters): {self.acceptance_length:.3f}** "
            f"({self.num_drafts} drafts of {len(self.per_position)} tokens over {self.num_prompts} prompts). "
            f"{self._pooled_and_mean()}{self._images()}\n\n{self._speed()}{self._engines()}"
            f"{header}\n{rule}\n{row}\n\n"
            f"Greedy output identical to the run without speculation: {self.identical}/{self.num_prompts} "
            f"({self.identical_share:.1%}); of the {len(self.divergences)} that differ, {self.near_ties} are proven "
            f"near-ties (each run chose its own top token and has the other's within {self.near_tie_gap} nats of it), "
            f"{unexplained} are not. Identical outside proven near-ties: {self.identical_share_outside_near_ties:.1%}.\n"
        )
        if self.agree_positions:
            text += (f"\nWhere the two runs agree ({self.agree_positions} positions), their top-1 minus runner-up "
                     f"logprob gaps differ at {self.agree_drift_nonzero}, by up to {self.agree_drift_max:.3g} nats "
                     f"(99th percentile {self.agree_drift_p99:.3g}): the rounding between the two engines' batch shapes.\n")
        return text + (self._divergence_table() if self.divergences else "")

    def _pooled_and_mean(self) -> str:
        pooled = ("This is the pooled figure, all requests' accepted tokens over all their drafts: the one vLLM's "
                  "metrics report (the `vllm:spec_decode_*` counters and its logged acceptance).")
        mean = self.request_mean_acceptance_length
        if mean is None:
            return pooled + " This vLLM gave no per-request metrics, so no mean per request."
        return (pooled + f" The mean per request, each request's own acceptance length averaged over the "
                f"{len(self.request_acceptance)} requests that drafted, is {mean:.3f}: it weighs a short request as "
                "much as a long one, so the two differ when acceptance varies with length.")

    def _images(self) -> str:
        if not self.prompts_with_images:
            return ""
        return (f" {self.prompts_with_images} of the prompts held images and were sent with them: "
                f"{self.prompt_tokens} prompt tokens as vLLM ran them, each image expanded to its image tokens.")

    def _speed(self) -> str:
        rates = self.tokens_per_second
        if rates is None or self.speedup is None:
            return ""
        text = (f"**Speedup: {self.speedup:.2f}x** ({rates[0]:.1f} tokens/s with the draft, {rates[1]:.1f} without; "
                f"greedy generation of the same {self.num_prompts} prompts, all submitted at once, loads excluded: "
                f"{self.seconds_speculative:.1f} s against {self.seconds_reference:.1f} s).")
        if self.speedup < 1:
            text += (" **At this concurrency the draft makes serving slower.** Each step runs the draft once per "
                     "draft token and verifies them all in one target pass; that pays only when a target pass costs "
                     "much more than a draft pass and verifying several tokens costs about as much as decoding one, "
                     "as for a large target on a GPU with few requests at once. On a CPU, with many requests at once, "
                     "or with a target barely larger than its draft, the draft's own cost and the longer verify pass "
                     "eat what the accepted tokens save. eval.served_concurrency measures the speed at the "
                     "concurrencies you serve.")
        return text + "\n\n"

    def _engines(self) -> str:
        if len(self.engines) != 2:
            return ""
        spec, ref = self.engines
        return f"Engines: with the draft {spec.describe()}; without it {ref.describe()}.\n\n"

    def _divergence_table(self) -> str:
        def cell(rank: int | None, gap: float | None) -> str:
            shown = f"rank {rank}" if rank is not None else f"not in top {self.top_logprobs}"
            return shown + (f", {gap:.3f}" if gap is not None else "")

        lines = ["", "| prompt | position | reference token | speculative token | spec token in reference run "
                 "(rank, gap) | ref token in speculative run (rank, gap) | class |", "|---|---|---|---|---|---|---|"]
        for d in self.divergences:
            kind = "near-tie" if d.is_near_tie(self.near_tie_gap) else "unexplained"
            lines.append(f"| {d.prompt_index} | {d.position} | {d.ref_token} | {d.spec_token} | "
                         f"{cell(d.ref_view.other_rank, d.ref_view.gap)} | {cell(d.spec_view.other_rank, d.spec_view.gap)} "
                         f"| {kind} |")
        return "\n".join(lines) + "\n"


def heldout_prompts(samples: Iterable[tuple[Sequence[int], Sequence[int]]], max_prompts: int, max_len: int) -> list[list[int]]:
    """Prompts of held-out samples: (input_ids, loss_mask) pairs -> the tokens before the first masked one.

    Samples without an assistant token, with no prompt before it, or with a prompt longer
    than `max_len` are skipped. At most `max_prompts`, in sample order.
    """
    return [prompt for _, prompt in heldout_prompt_rows(samples, max_prompts, max_len)]


def heldout_prompt_rows(samples: Iterable[tuple[Sequence[int], Sequence[int]]], max_prompts: int,
                        max_len: int) -> list[tuple[int, list[int]]]:
    """As heldout_prompts, each prompt with the index of its sample (to find the sample's data source)."""
    prompts = []
    for index, (input_ids, loss_mask) in enumerate(samples):
        first = next((i for i, m in enumerate(loss_mask) if m), None)
        if first is None or first == 0 or first > max_len:
            continue
        prompts.append((index, [int(t) for t in input_ids[:first]]))
        if len(prompts) == max_prompts:
            break
    return prompts


def with_images(rows: Sequence[tuple[int, list[int]]], sample_ids: Sequence[str], prepared: Mapping[str, TokenizedSample],
                placeholder: int | None) -> tuple[list[list[int]], list[list[str]]]:
    """The held-out prompts to send, and per prompt its image URLs: `rows` (sample index, prompt) as heldout_prompt_rows
    gives them from the store, whose ids hold each image expanded; a row whose sample (`sample_ids[index]`, looked up
    in `prepared`, TokenizedSample by id) has images is sent as prepared instead, its prompt up to its first learned
    token with one `placeholder` per image and the images those placeholders stand for."""
    prompts, images = [], []
    for index, prompt in rows:
        sample = prepared.get(sample_ids[index])
        if sample is None or not sample.images:
            prompts.append(prompt)
            images.append([])
            continue
        first = next(i for i, m in enumerate(sample.loss_mask) if m)
        ids = [int(t) for t in sample.input_ids[:first]]
        prompts.append(ids)
        images.append(list(sample.images[:ids.count(placeholder)]))
    return prompts, images


def first_difference(spec: Sequence[int], ref: Sequence[int]) -> int | None:
    """Index of the first token where two outputs differ (the shorter one's length when one is a prefix); None if equal."""
    if list(spec) == list(ref):
        return None
    return next((i for i, (a, b) in enumerate(zip(spec, ref, strict=False)) if a != b), min(len(spec), len(ref)))


def first_divergence(index: int, spec: vllm_serving.GreedyOutput, ref: vllm_serving.GreedyOutput) -> Divergence | None:
    """None when both outputs are the same tokens; else where they first differ and how each run ranked the two tokens."""
    position = first_difference(spec.token_ids, ref.token_ids)
    if position is None:
        return None
    spec_token = spec.token_ids[position] if position < len(spec.token_ids) else None
    ref_token = ref.token_ids[position] if position < len(ref.token_ids) else None
    ref_tops = ref.top_logprobs[position] if position < len(ref.top_logprobs) else {}
    spec_tops = spec.top_logprobs[position] if position < len(spec.top_logprobs) else {}
    return Divergence(index, position, spec_token, ref_token,
                      ref_view=RunView.of(ref_token, spec_token, ref_tops),
                      spec_view=RunView.of(spec_token, ref_token, spec_tops))


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
    sources: Sequence[str | None] = (),
    images: Sequence[Sequence[str]] = (),
    longest_prompt: int | None = None,
    setup: vllm_serving.ServingSetup = vllm_serving.ServingSetup(),
    speculative_method: str = "eagle3",
) -> ServedReport:
    """Serve the target with and without the draft on `prompts` (greedy) and compare; see the module docstring.
    `speculative_method`: vLLM's method for the draft folder ("dflash" for a DFlash export).
    `sources`: each prompt's data source (empty: none), for the per-source served figures. `images`: per prompt its
    image URLs (empty: text only), `longest_prompt` then the longest prompt as the engine runs it (images expanded).
    `setup`: how the engines run (vllm_serving.ServingSetup: by default as `vllm serve` runs them); each engine's mode
    and load time go into the report."""
    if not prompts:
        raise ValueError("no held-out prompts to serve; raise data.heldout_fraction or evaluate.served_max_prompts")
    pictures = list(images) if any(images) else None
    longest = max([len(p) for p in prompts] + ([longest_prompt] if longest_prompt else []))
    max_model_len = longest + max_new_tokens + num_draft_tokens + 1
    settings = dict(dtype=dtype, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib, images=pictures is not None,
                    setup=setup)
    vllm_adapter.release_all()  # one engine in memory at a time

    def run(**speculative: object) -> tuple[list[vllm_serving.GreedyOutput], float, vllm_serving.SpecDecodeCounters,
                                            vllm_serving.EngineMode]:
        started = time.monotonic()
        llm = vllm_serving.load_serving_engine(str(target_dir), **settings, **speculative)
        try:
            mode = vllm_serving.engine_mode(llm, time.monotonic() - started)
            before = vllm_serving.spec_decode_counters(llm)
            started = time.monotonic()
            outputs = vllm_serving.greedy_generate(llm, prompts, max_new_tokens=max_new_tokens,
                                                   num_logprobs=TOP_LOGPROBS, images=pictures)
            seconds = time.monotonic() - started
            return outputs, seconds, vllm_serving.spec_decode_counters(llm).minus(before), mode
        finally:
            vllm_adapter.shutdown_engine(llm)
            del llm

    spec, seconds_spec, counters, spec_mode = run(speculative_dir=str(export_dir), num_speculative_tokens=num_draft_tokens,
                                                  speculative_method=speculative_method)
    ref, seconds_ref, _, ref_mode = run()
    report = build_report(counters, spec, ref, num_draft_tokens, near_tie_gap, seconds_spec, seconds_ref, sources)
    return replace(report, prompts_with_images=sum(map(bool, images)), engines=[spec_mode, ref_mode])


def build_report(
    counters: vllm_serving.SpecDecodeCounters,
    spec: list[vllm_serving.GreedyOutput],
    ref: list[vllm_serving.GreedyOutput],
    num_draft_tokens: int,
    near_tie_gap: float,
    seconds_spec: float = 0.0,
    seconds_ref: float = 0.0,
    sources: Sequence[str | None] = (),
) -> ServedReport:
    """Turn counters and the two runs' outputs into a ServedReport (pure); `sources`: each prompt's data source."""
    if sources and len(sources) != len(spec):
        raise ValueError(f"{len(sources)} prompt sources for {len(spec)} prompts; expected one source per prompt")
    drafts = counters.drafts
    per_pos = list(counters.accepted_per_position) + [0] * (num_draft_tokens - len(counters.accepted_per_position))
    divergences = [d for i, (s, r) in enumerate(zip(spec, ref, strict=True)) if (d := first_divergence(i, s, r))]
    upto = {d.prompt_index: d.position for d in divergences}  # the runs agree before the first difference
    drift = sorted(x for i, (s, r) in enumerate(zip(spec, ref, strict=True))
                   for x in gap_drift(s, r, upto.get(i, len(r.token_ids))))
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
        request_drafts=[o.spec_steps for o in spec] if all(o.spec_steps is not None for o in spec) else [],
        request_accepted=[o.spec_accepted for o in spec] if all(o.spec_accepted is not None for o in spec) else [],
        reference_tokens=sum(len(o.token_ids) for o in ref),
        agree_positions=len(drift),
        agree_drift_max=drift[-1] if drift else 0.0,
        agree_drift_p99=drift[min(len(drift) - 1, int(0.99 * len(drift)))] if drift else 0.0,
        agree_drift_nonzero=sum(x > 0 for x in drift),
        request_sources=list(sources) if any(sources) else [],
        prompt_tokens=sum(o.prompt_tokens for o in ref),
    )


def served_stats(served: ServedReport | None) -> dict[str, object]:
    """The evaluate record's served figures (none when the served check did not run)."""
    if served is None:
        return {}
    stats: dict[str, object] = {
        "served_acceptance_length": round(served.acceptance_length, 4),
        "served_identical_share": round(served.identical_share, 4), "served_near_ties": served.near_ties,
        "served_num_drafts": served.num_drafts,
        "served_per_position": json.dumps([round(p, 4) for p in served.per_position])}
    if served.request_mean_acceptance_length is not None:
        stats["served_request_mean_acceptance_length"] = round(served.request_mean_acceptance_length, 4)
    if served.speedup is not None:
        stats["served_speedup"] = round(served.speedup, 4)
    return stats
