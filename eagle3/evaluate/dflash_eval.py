"""The evaluation of a DFlash draft (train.draft.method: dflash): its acceptance on held-out blocks, and the evaluate
stage's report for a DFlash export.

Held-out blocks: each held-out sample gets `anchors` random anchors, fixed (seeded by the sample's index), and the
draft fills each anchor's block as vLLM would. The acceptance length a chain verifier gives a block is 1 + the
drafted tokens that match the held-out answer before the first miss, averaged over the blocks. The walk drafts where a served greedy run drafts instead: from each answer's first token, block after block,
each anchored after the tokens the last one had accepted, pooled as vLLM pools its counters. The data are the
target's own answers (the regenerate stage), so both estimate what vLLM accepts; the walk is the one that tracks it
(on the demo's data with Muon: walk 1.805, vLLM 1.809, held-out blocks 1.996, which weigh every sample alike:
benchmarks/results/dflash-vs-eagle3-cpu-2026-12-06.txt). The train stage scores its checkpoints with both (the walk
picks the best); the evaluate stage reports them beside vLLM serving the export with method dflash and
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
from eagle3.capture.vllm_serving import ServingSetup
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


WALK_GROUP = 16  # held-out samples read and walked at once: their states padded to the longest, as one batch


def heldout_figures(model: DFlashDraft, embed: torch.Tensor, rows: Sequence, anchors: int) -> dict:
    """Both held-out figures, each sample read once (WALK_GROUP at a time). `rows`: (token ids, loss mask, aux states)
    per sample.

    Held-out blocks (`acceptance_length`, `per_position`, `num_drafts`): 1 + the drafted slots matching the data
    before the first miss, over `anchors` blocks per sample at anchors fixed by the sample's index (the same for every
    call); `per_position`: the share of blocks whose first k+1 slots all match.

    The walk (`walk`, `walk_per_position`, `walk_drafts`): what a served greedy run accepts on the held-out answers.
    From each answer's first token, the draft fills the block anchored there; the leading drafted tokens that match
    the answer are accepted, the target adds its own next token, and the next block is anchored after it, to the
    answer's end (a user turn is skipped to the next answer). Pooled as vLLM pools its counters: 1 + accepted tokens /
    drafts; `walk_per_position`: the share of drafts with at least j + 1 accepted."""
    size = model.config.block_size
    leading: list[torch.Tensor] = []  # per sample: [blocks, S-1], 1 while every slot so far matched
    accepted, drafts = torch.zeros(size - 1), 0  # drafts whose first j+1 tokens were all accepted
    with torch.no_grad():
        for first in range(0, len(rows), WALK_GROUP):
            group = [rows[i] for i in range(first, min(first + WALK_GROUP, len(rows)))]
            leading += [m for i, row in enumerate(group, first) if (m := _block_matches(model, embed, row, i, anchors))
                        is not None]
            taken = _walk_group(model, embed, group)  # [drafts, S-1]
            drafts += taken.shape[0]
            accepted += taken.sum(0).float()
    if leading:
        matched = torch.cat(leading).float()  # [blocks, S-1]
        blocks = {"acceptance_length": 1.0 + float(matched.sum(-1).mean()), "per_position": matched.mean(0).tolist(),
                  "num_drafts": int(matched.shape[0])}
    else:
        blocks = {"acceptance_length": 1.0, "per_position": [0.0] * (size - 1), "num_drafts": 0}
    if not drafts:
        return blocks | {"walk": 1.0, "walk_per_position": [0.0] * (size - 1), "walk_drafts": 0}
    return blocks | {"walk": 1.0 + float(accepted.sum()) / drafts, "walk_per_position": (accepted / drafts).tolist(),
                     "walk_drafts": drafts}


def _block_matches(model: DFlashDraft, embed: torch.Tensor, row: tuple, index: int, anchors: int) -> torch.Tensor | None:
    """Sample `index`'s held-out blocks: per block whose first drafted slot is an answer token, 1 while every slot so
    far matched [blocks, S-1]; None if it has no such block."""
    generator = torch.Generator().manual_seed(HELDOUT_SEED + index)
    blocks, aux = blocks_for(row, model.config, anchors, generator, embed.device)
    counted = blocks.weights[..., 0] > 0  # [1, A]
    if not counted.any():
        return None
    right = (block_logits(model, aux, embed, blocks).argmax(-1) == blocks.labels) & (blocks.weights > 0)
    return right.long().cumprod(-1)[counted].cpu()


def _walk_group(model: DFlashDraft, embed: torch.Tensor, rows: list) -> torch.Tensor:
    """The walk over `rows` at once, each sample's states padded to the longest: per draft, 1 while every
    drafted slot so far was accepted [drafts, S-1]."""
    config, device = model.config, embed.device
    size = config.block_size
    longest = max(int(ids.shape[0]) for ids, _, _ in rows)
    ids = torch.zeros(len(rows), longest + size, dtype=torch.long)  # + size: a block may run past the end
    answer = torch.zeros(len(rows), longest + size, dtype=torch.bool)
    aux = torch.zeros(len(rows), longest, *rows[0][2].shape[1:])
    for i, (row_ids, row_mask, row_aux) in enumerate(rows):
        ids[i, :len(row_ids)], answer[i, :len(row_ids)], aux[i, :len(row_ids)] = row_ids, row_mask.bool(), row_aux
    starts = [answer[i].nonzero().flatten().tolist() for i in range(len(rows))]
    at = {i: s[0] for i, s in enumerate(starts) if s and s[0] < len(rows[i][0]) - 1}  # sample -> its next anchor
    context = model.context(aux.to(device))  # [B, T, H]
    out = []
    while at:
        which = sorted(at)
        anchors = torch.tensor([at[i] for i in which])  # [b]
        tokens = torch.full((len(which), size), config.mask_token_id, dtype=torch.long)
        tokens[:, 0] = ids[which, anchors]
        hidden = model(context[which], embed[tokens.to(device)][:, None], anchors[:, None].to(device))  # [b, 1, S, H]
        guess = model.logits(hidden[:, 0, 1:]).argmax(-1).cpu()  # [b, S-1]
        slots = anchors[:, None] + 1 + torch.arange(size - 1)  # [b, S-1]: the positions each slot drafts
        rows_of = torch.tensor(which)[:, None]
        taken = ((guess == ids[rows_of, slots]) & answer[rows_of, slots]).long().cumprod(-1)  # [b, S-1]
        out.append(taken)
        for i, p, k in zip(which, anchors.tolist(), taken.sum(-1).tolist(), strict=True):
            p += k + 1  # the accepted tokens and the target's own next one
            if not answer[i, p]:  # the answer ended: on to the next one, if any
                p = next((q for q in starts[i] if q > p), longest)
            if p < len(rows[i][0]) - 1:
                at[i] = p
            else:
                del at[i]
    return torch.cat(out) if out else torch.zeros(0, size - 1, dtype=torch.long)


class StoreRows(Sequence):
    """A store's samples as (token ids, loss mask, aux states float32 [T, n, H]), each read from its shard when asked
    for: nothing is held in memory (a store of an 8B target is tens of GB in float32). `lengths` (tokens per sample)
    come from the shards' headers. The reader has verified every shard's checksum when it opened the store."""

    def __init__(self, reader: StoreReader) -> None:
        self.reader = reader
        self.lengths = reader.sample_lengths()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int | slice):  # Sequence's two forms: a row, or a list of rows
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        sample = self.reader[i]
        return as_row(sample.input_ids, sample.loss_mask, sample.hidden_states, len(self.reader.aux_layer_ids))


def as_row(ids: torch.Tensor, mask: torch.Tensor, states: torch.Tensor, n_aux: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stored sample as the DFlash trainer and evaluation take it: token ids, loss mask, aux states float32
    [T, n_aux, H] (the stored final layer dropped)."""
    return ids.long(), mask.bool(), states[:, :n_aux].float()


@dataclass(frozen=True)
class DFlashEvaluation:
    """What the evaluate stage writes for a DFlash export."""

    simulated: dict  # heldout_figures' figures
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
                 (f"**Walk (where a served greedy run drafts): {simulated['walk']:.3f}** ({simulated['walk_drafts']} "
                  "drafts: from each held-out answer's first token, each block anchored after what the last one "
                  "accepted; pooled as vLLM's counters are, the figure that tracks the served one)\n"
                  if "walk" in simulated else ""),
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
    embed = embed.float()
    simulated = heldout_figures(model, embed, rows, EVAL_ANCHORS)
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
