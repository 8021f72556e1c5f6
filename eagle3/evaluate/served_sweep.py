"""Served sweep: which num_speculative_tokens (k) serves fastest at each concurrency (issue 44, build item 2).

One engine is loaded without the draft and one per k in `eval.served_k`; on each, the held-out prompts are sent in
waves of c requests (one `llm.generate` call per wave) for each c in `eval.served_concurrency`. A wave of c requests
is what a server sees with c users each waiting for their answer: c sequences decode together in every step, the
batch shape at which speculation pays less as c grows. vLLM's `max_num_seqs` would give the same batch only with one
engine per concurrency (an engine load each); waves measure every concurrency on the one engine of each k.

Each (k, c) row holds the acceptance length (vLLM's pooled counters over the row's waves), tokens/s with and without
the draft (generated tokens over generation seconds, loads excluded) and their ratio, the speedup. For each c the
recommendation is the k of the fastest row, when it beats the target alone; else to serve without the draft.

The same sweep serves a DFlash export (method "dflash"): a DFlash draft drafts its whole block, so its only k is
block_size - 1 (eagle3.evaluate.dflash_eval); the rows then compare that k with the target alone per concurrency.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from eagle3.capture import vllm_adapter, vllm_serving
from eagle3.evaluate.acceptance import EvalConfig


@dataclass(frozen=True)
class SweepRow:
    """One measured (k, concurrency): vLLM's acceptance and the tokens/s with and without the draft."""

    k: int  # num_speculative_tokens
    concurrency: int  # requests in flight at once (the wave size)
    acceptance_length: float  # 1 + accepted draft tokens / drafts, vLLM's counters pooled over the row's waves
    tokens_per_second_draft: float
    tokens_per_second_target: float  # the same prompts in the same waves, served without the draft

    @property
    def speedup(self) -> float:
        """Tokens/s with the draft over without: above 1 the draft makes serving faster at this concurrency."""
        return self.tokens_per_second_draft / self.tokens_per_second_target if self.tokens_per_second_target > 0 else 0.0


@dataclass(frozen=True)
class Recommendation:
    """What to serve at one concurrency: the fastest k, or None when no k beats the target alone."""

    concurrency: int
    k: int | None
    speedup: float  # of the fastest row (below 1 when k is None)
    speculative_config: str | None  # the JSON to paste after `vllm serve ... --speculative-config`


@dataclass(frozen=True)
class SweepReport:
    """The sweep's rows and, per concurrency, the recommendation they give."""

    export_dir: str
    rows: list[SweepRow]
    # how each engine ran and how long it took to load: "target" (no draft) and "k=N" (empty: not recorded)
    engines: dict[str, vllm_serving.EngineMode] = field(default_factory=dict)
    method: str = "eagle3"  # vLLM's speculative method for the draft: "eagle3", or "dflash" for a DFlash export

    def recommendations(self) -> list[Recommendation]:
        out = []
        for c in sorted({r.concurrency for r in self.rows}):
            best = max((r for r in self.rows if r.concurrency == c), key=lambda r: (r.speedup, -r.k))
            k = best.k if best.speedup > 1.0 else None
            pasted = None if k is None else speculative_config(self.export_dir, k, self.method)
            out.append(Recommendation(c, k, best.speedup, pasted))
        return out

    def to_dict(self) -> dict[str, object]:
        return {"rows": [asdict(r) | {"speedup": r.speedup} for r in self.rows],
                "recommendation": [asdict(r) for r in self.recommendations()],
                "engines": {name: asdict(mode) for name, mode in self.engines.items()}, "method": self.method}

    def to_markdown(self, plot: str | None = None) -> str:
        """The rows as a table, `plot` (a PNG beside acceptance.md) under it, then the recommendation per concurrency."""
        lines = ["### Speed per concurrency and k", "",
                 "| k | concurrency | acceptance length | tokens/s with draft | tokens/s without | speedup |",
                 "|---|---|---|---|---|---|"]
        for r in sorted(self.rows, key=lambda r: (r.concurrency, r.k)):
            lines.append(f"| {r.k} | {r.concurrency} | {r.acceptance_length:.3f} | {r.tokens_per_second_draft:.1f} | "
                         f"{r.tokens_per_second_target:.1f} | {r.speedup:.2f}x |")
        if plot:
            lines += ["", f"![speedup per concurrency and k]({plot})"]
        lines += ["", "**Recommendation** (per concurrency, from the rows above):", ""]
        for rec in self.recommendations():
            if rec.k is None:
                lines.append(f"- concurrency {rec.concurrency}: serve without the draft: at every k it is slower than "
                             f"the target alone here (best {rec.speedup:.2f}x).")
            else:
                lines.append(f"- concurrency {rec.concurrency}: k={rec.k} ({rec.speedup:.2f}x): "
                             f"`--speculative-config '{rec.speculative_config}'`")
        if self.engines:
            lines += ["", "Engines (one load each):", ""]
            lines += [f"- {name}: {mode.describe()}" for name, mode in self.engines.items()]
        return "\n".join(lines) + "\n"


def speculative_config(export_dir: str, k: int, method: str = "eagle3") -> str:
    """The `vllm serve --speculative-config` value serving the exported draft at k draft tokens with `method`."""
    return json.dumps({"method": method, "model": export_dir, "num_speculative_tokens": k})


def waves(prompts: Sequence[Sequence[int]], concurrency: int) -> list[list[list[int]]]:
    """The prompts in groups of `concurrency` (the last may be smaller), in order."""
    return [[list(p) for p in prompts[i:i + concurrency]] for i in range(0, len(prompts), concurrency)]


def _measure(llm, prompts: Sequence[Sequence[int]], concurrency: int,
             max_new_tokens: int) -> tuple[list[vllm_serving.GreedyOutput], float, vllm_serving.SpecDecodeCounters]:
    """Generate every wave in turn on `llm`: (outputs in prompt order, generation seconds, counters moved)."""
    before = vllm_serving.spec_decode_counters(llm)
    outputs, seconds = [], 0.0
    for wave in waves(prompts, concurrency):
        started = time.monotonic()
        outputs += vllm_serving.greedy_generate(llm, wave, max_new_tokens=max_new_tokens, num_logprobs=0)
        seconds += time.monotonic() - started
    return outputs, seconds, vllm_serving.spec_decode_counters(llm).minus(before)


def served_sweep(target_dir: Path, export_dir: Path, prompts: list[list[int]], *, ks: Sequence[int],
                 concurrencies: Sequence[int], max_new_tokens: int, dtype: str = "auto",
                 kv_cache_gib: float = 1.0, setup: vllm_serving.ServingSetup = vllm_serving.ServingSetup(),
                 method: str = "eagle3") -> tuple[SweepReport, dict[int, int]]:
    """Load the target without the draft, then with it at each k, and measure every concurrency on each engine
    (len(ks) + 1 loads). Returns the report and, per k, how many outputs differ from the target's greedy ones.
    `method`: vLLM's speculative method for `export_dir` ("dflash" for a DFlash export)."""
    if not prompts:
        raise ValueError("no held-out prompts to serve; raise data.heldout_fraction or evaluate.served_max_prompts")
    max_model_len = max(len(p) for p in prompts) + max_new_tokens + max(ks) + 1
    settings = {"dtype": dtype, "max_model_len": max_model_len, "kv_cache_gib": kv_cache_gib, "images": False,
                "setup": setup}
    engines: dict[str, vllm_serving.EngineMode] = {}

    def run(**speculative: object) -> dict[int, tuple[list[vllm_serving.GreedyOutput], float, vllm_serving.SpecDecodeCounters]]:
        vllm_adapter.release_all()  # one engine in memory at a time
        started = time.monotonic()
        llm = vllm_serving.load_serving_engine(str(target_dir), **settings, **speculative)
        try:
            name = f"k={speculative['num_speculative_tokens']}" if speculative else "target"
            engines[name] = vllm_serving.engine_mode(llm, time.monotonic() - started)
            return {c: _measure(llm, prompts, c, max_new_tokens) for c in concurrencies}
        finally:
            vllm_adapter.shutdown_engine(llm)
            del llm

    reference = run()
    rows, changed = [], {}
    for k in ks:
        measured = run(speculative_dir=str(export_dir), num_speculative_tokens=k, speculative_method=method)
        changed[k] = 0
        for c in concurrencies:
            spec, seconds, counters = measured[c]
            ref, seconds_ref, _ = reference[c]
            changed[k] = max(changed[k], sum(s.token_ids != r.token_ids for s, r in zip(spec, ref, strict=True)))
            rate = sum(len(o.token_ids) for o in spec) / seconds if seconds > 0 else 0.0
            rate_ref = sum(len(o.token_ids) for o in ref) / seconds_ref if seconds_ref > 0 else 0.0
            drafts = counters.drafts
            rows.append(SweepRow(k, c, 1.0 + counters.accepted_tokens / drafts if drafts else 1.0, rate, rate_ref))
    return SweepReport(str(export_dir), rows, engines, method), changed


def configured_sweep(config: EvalConfig, target_dir: Path, export_dir: Path, prompts: list[list[int]],
                     images: Sequence[Sequence[str]], serving: vllm_serving.ServingSetup, *, method: str = "eagle3",
                     ks: Sequence[int] | None = None) -> SweepReport | None:
    """The sweep the evaluate stage runs when eval.served_concurrency or eval.served_k is set; else None.
    `ks`: the k to try, when the draft fixes them (a DFlash draft: [block_size - 1]); else eval.served_k, or
    [eval.num_draft_tokens] when that is empty. `images`: the prompts' image URLs (the sweep sends text only)."""
    if not config.served_concurrency and not config.served_k:
        return None
    if any(images):
        raise ValueError("eval.served_concurrency / eval.served_k: the served sweep sends text prompts only, and these "
                         "held-out prompts hold images; expected text-only held-out data, or leave both settings empty")
    report, _ = served_sweep(target_dir, export_dir, prompts, ks=ks or config.served_k or [config.num_draft_tokens],
                             concurrencies=config.served_concurrency or [len(prompts)],
                             max_new_tokens=config.served_max_new_tokens, dtype=config.served_dtype,
                             kv_cache_gib=config.served_kv_cache_gib, setup=serving, method=method)
    return report
