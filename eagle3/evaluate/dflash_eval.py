"""The evaluation of a DFlash draft (train.draft.method: dflash): its acceptance on held-out blocks, and the evaluate
stage's report for a DFlash export.

Held-out blocks: each held-out sample gets `anchors` random anchors, fixed (seeded by the sample's index), and the
draft fills each anchor's block as vLLM would. The acceptance length a chain verifier gives a block is 1 + the
drafted tokens that match the held-out answer before the first miss, averaged over the blocks. The data are the
target's own answers (the regenerate stage), so this estimates what vLLM accepts; the served check measures it (on
the demo's data the two agreed within 0.01: benchmarks/results/dflash-vs-eagle3-cpu-2026-12-06.txt). The train stage
scores its checkpoints with it; the evaluate stage reports it beside vLLM serving the export with method dflash and
num_speculative_tokens = block_size - 1 (a DFlash draft drafts its whole block, so eval.num_draft_tokens and the
sweep's eval.served_k do not apply), and with eval.served_concurrency or eval.served_k set, the served sweep
(eagle3.evaluate.served_sweep) at that one k.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.capture.store import StoreReader
from eagle3.capture.vllm_adapter import ServingSetup
from eagle3.draft.batches import shard_header
from eagle3.draft.dflash import (
    Blocks,
    DFlashConfig,
    DFlashDraft,
    block_logits,
    sample_blocks,
)
from eagle3.draft.dflash_export import load_exported_dflash
from eagle3.evaluate.acceptance import EvalConfig
from eagle3.evaluate.plots import SWEEP_PNG
from eagle3.evaluate.served_eval import ServedReport, served_acceptance, served_stats
from eagle3.evaluate.served_sweep import SweepReport, configured_sweep

HELDOUT_SEED = 12345  # the held-out anchors: the same for every checkpoint and for the evaluation
EVAL_ANCHORS = 32  # held-out blocks the evaluate stage scores per sample


def blocks_for(row: tuple[torch.Tensor, torch.Tensor, torch.Tensor], config: DFlashConfig, anchors: int,
                generator: torch.Generator, device: torch.device) -> tuple[Blocks, torch.Tensor]:
    """One sample's (token ids, loss mask, aux states) as the blocks of `anchors` random anchors and its aux [1, T, n, H]
    on `device`."""
    ids, mask, aux = (t.to(device) for t in row)
    blocks = sample_blocks(ids[None], mask[None], config, anchors, generator)  # one row: [1, A, ...]
    return blocks, aux[None]  # aux [1, T, n, H]


def heldout_acceptance(model: DFlashDraft, embed: torch.Tensor, rows: Sequence, anchors: int) -> dict:
    """1 + the drafted slots matching the data before the first miss, over the held-out blocks (module docstring);
    `per_position`: the share of blocks whose first k+1 slots all match. `rows`: (token ids, loss mask, aux states)
    per sample; the anchors are the same for every call."""
    config, device = model.config, embed.device
    leading: list[torch.Tensor] = []
    with torch.no_grad():
        for index, row in enumerate(rows):
            blocks, aux = blocks_for(row, config, anchors, torch.Generator().manual_seed(HELDOUT_SEED + index), device)
            counted = blocks.weights[..., 0] > 0  # [1, A]: blocks whose first drafted slot is an answer token
            if not counted.any():
                continue
            right = (block_logits(model, aux, embed, blocks).argmax(-1) == blocks.labels) & (blocks.weights > 0)
            leading.append(right.long().cumprod(-1)[counted].cpu())  # [blocks, S-1]: 1 while every slot so far matched
    if not leading:
        return {"acceptance_length": 1.0, "per_position": [0.0] * (config.block_size - 1), "num_drafts": 0}
    matched = torch.cat(leading).float()  # [blocks, S-1]
    return {"acceptance_length": 1.0 + float(matched.sum(-1).mean()), "per_position": matched.mean(0).tolist(),
            "num_drafts": int(matched.shape[0])}


class StoreRows(Sequence):
    """A store's samples as (token ids, loss mask, aux states float32 [T, n, H]), each read from its shard when asked
    for: nothing is held in memory (a store of an 8B target is tens of GB in float32). `lengths` (tokens per sample)
    come from the shards' headers. The reader has verified every shard's checksum when it opened the store."""

    def __init__(self, reader: StoreReader) -> None:
        self.reader = reader
        self.lengths = [shard_header(str(reader.root / e.file))[1][f"{j}.input_ids"]["shape"][0]
                        for e in reader.shards for j in range(len(e.sample_ids))]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int | slice):  # Sequence's two forms: a row, or a list of rows
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        sample = self.reader[i]
        n = len(self.reader.aux_layer_ids)
        return sample.input_ids.long(), sample.loss_mask.bool(), sample.hidden_states[:, :n].float()


@dataclass(frozen=True)
class DFlashEvaluation:
    """What the evaluate stage writes for a DFlash export."""

    simulated: dict  # heldout_acceptance's figures
    served: ServedReport | None
    num_speculative_tokens: int
    sweep: SweepReport | None = None  # the served sweep at k = num_speculative_tokens (eval.served_concurrency)

    def payload(self) -> dict:
        """acceptance.json (its "plots" empty: the evaluate stage lists the sweep's plot when it writes it)."""
        out = {"simulated": self.simulated | {"method": "dflash", "num_speculative_tokens": self.num_speculative_tokens},
               "served": self.served.to_dict() if self.served is not None else None, "plots": []}
        if self.sweep is not None:
            out["served_sweep"] = self.sweep.to_dict()
        return out

    def markdown(self, served_k_set: bool = False) -> str:
        """acceptance.md; `served_k_set`: eval.served_k is set (then it says why the sweep ran at one k only)."""
        k, simulated = self.num_speculative_tokens, self.simulated
        positions = " | ".join(str(j) for j in range(1, k + 1))
        shares = " | ".join(f"{p:.3f}" for p in simulated["per_position"])
        parts = ["# Acceptance (DFlash draft)\n",
                 (f"## (a) Held-out blocks\n\n**Acceptance length (held-out blocks): "
                  f"{simulated['acceptance_length']:.3f}** ({simulated['num_drafts']} blocks of {k} drafted tokens: "
                  "1 + the drafted tokens that match the held-out answer before the first miss, as a chain verifier "
                  "accepts them)\n"),
                 f"| draft position | {positions} |\n|---|{'---|' * k}\n| all matched so far | {shares} |\n",
                 "## (b) Served by vLLM (speculative decoding, method dflash)\n",
                 self.served.to_markdown() if self.served is not None else "Not run (evaluate.served is off).\n"]
        if self.sweep is not None:
            parts.append(self.sweep.to_markdown(plot=SWEEP_PNG))
            if served_k_set:
                parts.append(f"eval.served_k does not apply to a DFlash draft: it drafts its whole block, so the sweep "
                             f"measured k = block_size - 1 = {k} only.\n")
        return "\n".join(parts)

    def stats(self) -> dict[str, object]:
        """The evaluate record's stats."""
        simulated = self.simulated
        return {"acceptance_length": round(simulated["acceptance_length"], 4), "num_drafts": simulated["num_drafts"],
                "per_position": json.dumps([round(p, 4) for p in simulated["per_position"]]),
                "method": "dflash"} | served_stats(self.served)


def evaluate_dflash(config: EvalConfig, export_dir: Path, reader: StoreReader, embed: torch.Tensor, *,
                    target_dir: Path, prompts: list[list[int]], sources: Sequence[str | None],
                    images: Sequence[Sequence[str]], longest: int, serving: ServingSetup,
                    on_simulated: Callable[[int, int, int], None], on_served: Callable[[int], None]) -> DFlashEvaluation:
    """(a) the held-out blocks of `reader` (the held-out store); (b) with eval.served, vLLM serving the export beside
    the target on `prompts` (as served_acceptance does for EAGLE-3, with method dflash), and with
    eval.served_concurrency or eval.served_k set, the served sweep at the draft's one k (its block_size - 1)."""
    model = load_exported_dflash(export_dir)
    rows = StoreRows(reader)
    simulated = heldout_acceptance(model, embed.float(), rows, EVAL_ANCHORS)
    on_simulated(len(rows), len(rows), 0)
    k = model.config.num_speculative_tokens
    served = None
    if config.served:
        served = served_acceptance(
            target_dir, export_dir, prompts, num_draft_tokens=k, max_new_tokens=config.served_max_new_tokens,
            dtype=config.served_dtype, kv_cache_gib=config.served_kv_cache_gib,
            near_tie_gap=config.near_tie_logprob_gap, sources=sources, images=images, longest_prompt=longest,
            setup=serving, speculative_method="dflash")
        on_served(served.generated_tokens)
    sweep = configured_sweep(config, target_dir, export_dir, prompts, images, serving, method="dflash",
                             ks=[k]) if config.served else None
    return DFlashEvaluation(simulated, served, k, sweep)
