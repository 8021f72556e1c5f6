"""Stage entry points of the draft side: vocab, train, export, evaluate.

Same contract as eagle3.stages: settings + upstream records in, one whole artifact out at
`<artifact_root>/<stage>/<fingerprint>/`, returned without work when already there.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from eagle3 import data
from eagle3.artifacts import StageRecord, building, mark_complete
from eagle3.evaluate import EvalConfig, simulate_acceptance
from eagle3.export import export_draft
from eagle3.stages import _done, stage_fingerprint
from eagle3.store import StoreReader, atomic_write_text
from eagle3.target import HEAD_FILE, TargetInfo
from eagle3.target_head import load_target_head, read_target_config
from eagle3.train import TrainConfig, train_draft
from eagle3.vocab import VocabConfig, build_mapping, count_tokens, save_mapping

VOCAB_FILE = "vocab.safetensors"
TrainProgress = Callable[[int, int, float], None]


# -- vocab -------------------------------------------------------------------------------
def fingerprint_vocab(config: VocabConfig, prepared: StageRecord) -> str:
    return stage_fingerprint("vocab", config, prepared.fingerprint)


def run_vocab(config: VocabConfig, prepared: StageRecord, target: StageRecord, root: Path, fp: str) -> StageRecord:
    final, done = _done(root, "vocab", fp)
    if done:
        return done
    info = TargetInfo.read(target.path)
    samples = data.read_samples(prepared.path / "train.jsonl")
    pairs = ((torch.tensor(s.input_ids), torch.tensor(s.loss_mask, dtype=torch.bool)) for s in samples)
    counts = count_tokens(pairs, info.vocab_size)  # [V] over loss-masked tokens only
    mapping = build_mapping(counts, config.draft_vocab_size)
    covered = float(counts[mapping.t2d].sum()) / max(float(counts.sum()), 1.0)
    with building(final) as tmp:
        save_mapping(mapping, tmp / VOCAB_FILE)
        stats = {"draft_vocab_size": config.draft_vocab_size, "target_vocab_size": info.vocab_size,
                 "token_coverage": round(covered, 4)}
        return mark_complete(tmp, StageRecord(stage="vocab", uri=str(final), fingerprint=fp, stats=stats))


# -- train -------------------------------------------------------------------------------
def fingerprint_train(config: TrainConfig, extracted: StageRecord, vocab: StageRecord, target: StageRecord) -> str:
    return stage_fingerprint("train", config, extracted.fingerprint, vocab.fingerprint, target.fingerprint)


def run_train(config: TrainConfig, target: StageRecord, extracted: StageRecord, vocab: StageRecord, root: Path, fp: str,
              progress: TrainProgress | None = None) -> StageRecord:
    """Trains in place (checkpoints under the artifact folder), so a killed run resumes."""
    final, done = _done(root, "train", fp)
    if done:
        return done
    info = TargetInfo.read(target.path)
    result = train_draft(
        config, store_dir=extracted.path / "train", target_dir=Path(info.model_dir), head_path=target.path / HEAD_FILE,
        vocab_path=vocab.path / VOCAB_FILE, out_dir=final, progress=progress,
    )
    if result.checkpoint is None:
        raise RuntimeError(f"training in {final} ended without a checkpoint")
    stats = {
        "steps": result.steps_done, "final_loss": round(result.losses[-1], 5) if result.losses else float("nan"),
        "tokens_seen": result.tokens_seen, "seconds": round(result.seconds, 2),
        "resumed_from_step": -1 if result.resumed_from_step is None else result.resumed_from_step,
        "checkpoint": str(Path(result.checkpoint).relative_to(final)),
    }
    return mark_complete(final, StageRecord(stage="train", uri=str(final), fingerprint=fp, stats=stats))


# -- export ------------------------------------------------------------------------------
def fingerprint_export(trained: StageRecord) -> str:
    return stage_fingerprint("export", {}, trained.fingerprint)


def run_export(target: StageRecord, trained: StageRecord, vocab: StageRecord, root: Path, fp: str) -> StageRecord:
    final, done = _done(root, "export", fp)
    if done:
        return done
    info = TargetInfo.read(target.path)
    checkpoint = trained.path / str(trained.stats["checkpoint"])
    export_draft(checkpoint, final, target_dir=Path(info.model_dir), aux_layer_ids=info.aux_layer_ids,
                 vocab_path=vocab.path / VOCAB_FILE)
    stats = {"checkpoint": str(checkpoint), "bytes": sum(p.stat().st_size for p in final.iterdir() if p.is_file())}
    return mark_complete(final, StageRecord(stage="export", uri=str(final), fingerprint=fp, stats=stats))


# -- evaluate ----------------------------------------------------------------------------
def fingerprint_evaluate(config: EvalConfig, exported: StageRecord, extracted: StageRecord) -> str:
    return stage_fingerprint("evaluate", config, exported.fingerprint, extracted.fingerprint)


def run_evaluate(config: EvalConfig, target: StageRecord, exported: StageRecord, extracted: StageRecord,
                 root: Path, fp: str) -> StageRecord:
    final, done = _done(root, "evaluate", fp)
    if done:
        return done
    heldout = extracted.path / "heldout"
    if len(StoreReader(heldout)) == 0:
        raise ValueError("no held-out samples to evaluate on; raise data.heldout_fraction or data.max_samples")
    info = TargetInfo.read(target.path)
    head = load_target_head(target.path / HEAD_FILE, read_target_config(Path(info.model_dir)))
    report = simulate_acceptance(exported.path, heldout, head, num_draft_tokens=config.num_draft_tokens)
    with building(final) as tmp:
        payload = {"simulated": {"acceptance_length": report.acceptance_length, "per_position": report.per_position,
                                 "num_drafts": report.num_drafts,
                                 "served_acceptance_length": report.served_acceptance_length,
                                 "served_num_drafts": report.served_num_drafts}}
        atomic_write_text(tmp / "acceptance.json", json.dumps(payload, indent=1))
        atomic_write_text(tmp / "acceptance.md", report.to_markdown())
        stats = {"acceptance_length": round(report.acceptance_length, 4), "num_drafts": report.num_drafts,
                 "per_position": json.dumps([round(p, 4) for p in report.per_position])}
        return mark_complete(tmp, StageRecord(stage="evaluate", uri=str(final), fingerprint=fp, stats=stats))
