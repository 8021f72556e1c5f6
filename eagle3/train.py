"""Training the EAGLE-3 draft on stored hidden states, with TTT, checkpoints and resume.

Loss: for every TTT step j (see eagle3.draft for the alignment), KL(target || draft)
where the target distribution is softmax over the draft vocabulary of the target's own
logits lm_head(norm(final state)) gathered at the draft vocabulary's target ids. Each
row is weighted by the loss mask of the token it predicts; a step's loss is the weighted
mean over rows, the total is the mean over steps. AdamW, linear warm-up, cosine decay.

Data: samples are packed (whole, in a seeded per-epoch permutation) into micro-batches of
at most `batch_tokens` tokens; attention never crosses a sample boundary. The data
position (epoch, cursor) is part of every checkpoint, so a resumed run sees exactly the
batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from safetensors import safe_open

from eagle3.checkpoint import Checkpoint, clean_temporaries, latest_valid_checkpoint, save_checkpoint
from eagle3.draft import DraftConfig, Eagle3Draft, init_draft, ttt_alignment
from eagle3.store import Sample, StoreReader, atomic_write_text
from eagle3.target_head import TargetHead, load_target_head, read_target_config, target_logits
from eagle3.vocab import VocabMapping, load_mapping

log = logging.getLogger(__name__)

LOSSES = "losses.jsonl"
CHECKPOINTS = "checkpoints"
# Settings that may change between an interrupted run and its resume.
_RESUMABLE_CHANGES = {"steps", "checkpoint_every", "num_draft_tokens_eval"}


class TrainError(RuntimeError):
    """Training cannot start or resume; the message names the setting or file."""


class TrainConfig(BaseModel):
    """Settings of the train stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(default=2000, gt=0, description="Optimizer steps to train for in total (resumes count).")
    learning_rate: float = Field(default=1e-4, gt=0, description="Peak AdamW learning rate, reached after warm-up.")
    warmup_steps: int = Field(default=50, ge=0, description="Steps of linear warm-up from 0 to learning_rate.")
    min_lr_ratio: float = Field(
        default=0.1, ge=0, le=1, description="Cosine decay ends at learning_rate * min_lr_ratio at the last step."
    )
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay on matrices (never on norms).")
    batch_tokens: int = Field(
        default=2048, gt=0, description="Tokens per micro-batch: whole samples are packed up to this many "
        "(a longer sample is cut to this length)."
    )
    grad_accum: int = Field(default=1, ge=1, description="Micro-batches whose gradients add up to one step.")
    ttt_steps: int = Field(default=3, ge=1, description="TTT unroll depth: draft tokens trained per position.")
    checkpoint_every: int = Field(
        default=200, ge=1, description="Write a checkpoint every this many steps (and at the end)."
    )
    seed: int = Field(default=0, description="Seeds the draft's initial weights and the data order.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="Compute dtype: 'auto' is bfloat16 autocast on CUDA, float32 on the CPU."
    )
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradients are clipped to this global norm.")
    num_draft_tokens_eval: int = Field(
        default=3, ge=1, description="Draft tokens per draft when checkpoints are evaluated for acceptance."
    )

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.warmup_steps >= self.steps:
            raise ValueError(f"train.warmup_steps ({self.warmup_steps}) must be below train.steps ({self.steps})")
        return self


@dataclass(frozen=True)
class TrainResult:
    """What a call of train_draft did. `losses` is the whole trajectory, resumed steps included."""

    checkpoint: Path | None
    steps_done: int
    losses: list[float]
    tokens_seen: int
    seconds: float
    resumed_from_step: int | None


@dataclass(frozen=True)
class MicroBatch:
    """Packed samples. L = total tokens, K = TTT steps."""

    aux: torch.Tensor  # [L, n_aux, H]
    final: torch.Tensor  # [L, H] target final states (before its norm)
    step_tokens: torch.Tensor  # [K, L] int64 input token of each step
    positions: torch.Tensor  # [L] int64 position inside its sample
    doc_ids: torch.Tensor  # [L] int64 sample index inside the batch
    target_rows: torch.Tensor  # [K, L] int64 row (in this batch) of the target distribution
    weights: torch.Tensor  # [K, L] float loss weight

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def pack(samples: list[Sample], steps: int, max_tokens: int) -> MicroBatch:
    """Concatenate samples (each cut to max_tokens) into one TTT micro-batch."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in MicroBatch.__dataclass_fields__}
    offset = 0
    for doc, sample in enumerate(samples):
        length = min(sample.num_tokens, max_tokens)
        ids, mask = sample.input_ids[:length], sample.loss_mask[:length]
        states = sample.hidden_states[:length]  # [T, n_aux+1, H]
        step_tokens, target_pos, weights = ttt_alignment(ids, mask, steps)  # [K, T] each
        parts["aux"].append(states[:, :-1])
        parts["final"].append(states[:, -1])
        parts["step_tokens"].append(step_tokens)
        parts["positions"].append(torch.arange(length))
        parts["doc_ids"].append(torch.full((length,), doc))
        parts["target_rows"].append(target_pos + offset)
        parts["weights"].append(weights.float())
        offset += length
    dims = {"step_tokens": 1, "target_rows": 1, "weights": 1}
    return MicroBatch(**{k: torch.cat(v, dim=dims.get(k, 0)) for k, v in parts.items()})


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The sample order of one epoch: a permutation fixed by (seed, epoch)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def next_batch_indices(
    lengths: list[int], seed: int, epoch: int, cursor: int, max_tokens: int
) -> tuple[list[int], int, int]:
    """Sample indices of the next micro-batch and the new (epoch, cursor). Batches never span epochs."""
    if cursor >= len(lengths):
        epoch, cursor = epoch + 1, 0
    order = epoch_order(len(lengths), seed, epoch).tolist()
    chosen, used = [], 0
    while cursor < len(order):
        size = min(lengths[order[cursor]], max_tokens)
        if chosen and used + size > max_tokens:
            break
        chosen.append(order[cursor])
        used += size
        cursor += 1
    return chosen, epoch, cursor


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then cosine decay."""
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.learning_rate * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)


def kl_loss(draft_logits: torch.Tensor, target_logp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted mean over rows of KL(target || draft). [L, Vd], [L, Vd], [L] -> scalar."""
    draft_logq = F.log_softmax(draft_logits.float(), dim=-1)  # [L, Vd]
    kl = (target_logp.exp() * (target_logp - draft_logq)).sum(-1)  # [L]
    return (kl * weights).sum() / weights.sum().clamp_min(1.0)


def batch_loss(
    model: Eagle3Draft, batch: MicroBatch, head: TargetHead, draft_rows: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Mean-over-steps loss and the per-step losses of one micro-batch."""
    with torch.no_grad():
        logits = target_logits(head, batch.final, rows=draft_rows)  # [L, Vd]
        target_logp = F.log_softmax(logits.float(), dim=-1)  # [L, Vd]
    per_step = []
    drafts = model.unroll(batch.aux, batch.step_tokens, batch.positions, batch.doc_ids, head.embed)
    for step, draft_logits in enumerate(drafts):  # draft_logits [L, Vd]
        per_step.append(kl_loss(draft_logits, target_logp[batch.target_rows[step]], batch.weights[step]))
    return torch.stack(per_step).mean(), per_step


@dataclass
class _Run:
    """Everything train_draft holds between steps."""

    config: TrainConfig
    reader: StoreReader
    lengths: list[int]
    model: Eagle3Draft
    optimizer: torch.optim.Optimizer
    head: TargetHead
    draft_rows: torch.Tensor
    device: torch.device
    autocast: bool
    meta: dict[str, object]
    step: int = 0
    epoch: int = 0
    cursor: int = 0
    tokens_seen: int = 0


def _device_and_autocast(config: TrainConfig) -> tuple[torch.device, bool]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = config.dtype == "bfloat16" or (config.dtype == "auto" and device.type == "cuda")
    return device, bf16


def _setup(config: TrainConfig, store_dir: Path, target_dir: Path, head_path: Path, vocab_path: Path) -> _Run:
    reader = StoreReader(store_dir)
    target = read_target_config(target_dir)
    mapping: VocabMapping = load_mapping(vocab_path)
    if mapping.target_vocab_size != target.vocab_size:
        raise TrainError(
            f"vocab file {vocab_path} maps a vocabulary of {mapping.target_vocab_size}, the target "
            f"{target_dir} has {target.vocab_size}; rebuild the vocab stage for this target"
        )
    if reader.hidden_size != target.hidden_size:
        raise TrainError(f"store {store_dir} has hidden size {reader.hidden_size}, the target {target.hidden_size}")
    if len(reader) == 0:
        raise TrainError(f"store {store_dir} holds no samples; check the data and extract stages")
    draft_config = DraftConfig.from_target(
        target, num_aux_hidden_states=len(reader.aux_layer_ids), draft_vocab_size=mapping.draft_vocab_size
    )
    device, bf16 = _device_and_autocast(config)
    head = load_target_head(head_path, target)
    model = Eagle3Draft(draft_config)
    init_draft(model, head, mapping, config.seed)
    model.to(device)
    head = head.to(torch.bfloat16 if bf16 else torch.float32, device)
    decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.learning_rate, betas=(0.9, 0.95),
    )
    meta = {"train_config": config.model_dump(), "draft_config": draft_config.model_dump(),
            "aux_layer_ids": reader.aux_layer_ids, "num_samples": len(reader)}
    lengths = _sample_lengths(reader)
    if too_long := sum(length > config.batch_tokens for length in lengths):
        log.warning("%d of %d samples are longer than train.batch_tokens=%d; they are cut to that length",
                    too_long, len(lengths), config.batch_tokens)
    return _Run(config, reader, lengths, model, optimizer, head, mapping.target_ids.to(device), device, bf16, meta)


def _sample_lengths(reader: StoreReader) -> list[int]:
    """Token count of every sample, in store order, from the shard headers (no tensor is read)."""
    lengths = []
    for entry in reader.shards:
        with safe_open(str(reader.root / entry.file), framework="pt") as handle:
            lengths += [handle.get_slice(f"{j}.input_ids").get_shape()[0] for j in range(len(entry.sample_ids))]
    return lengths


def _resume(run: _Run, out_dir: Path) -> int | None:
    """Load the newest valid checkpoint into `run`; returns its step (None when starting fresh)."""
    clean_temporaries(out_dir / CHECKPOINTS)
    found: Checkpoint | None = latest_valid_checkpoint(out_dir / CHECKPOINTS)
    if found is None:
        return None
    _check_compatible(found, run)
    run.model.load_state_dict(found.weights)
    state = found.state
    run.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["cpu"])
    if torch.cuda.is_available() and state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    run.step, run.epoch, run.cursor = found.step, int(state["data"]["epoch"]), int(state["data"]["cursor"])
    run.tokens_seen = int(state["tokens_seen"])
    return found.step


def _check_compatible(found: Checkpoint, run: _Run) -> None:
    for key in ("draft_config", "aux_layer_ids", "num_samples"):
        if found.meta.get(key) != run.meta[key]:
            raise TrainError(
                f"checkpoint {found.path} has {key} {found.meta.get(key)}, this run {run.meta[key]}: it was "
                "trained on other data or another draft shape; use a fresh out_dir"
            )
    old, new = found.meta.get("train_config", {}), run.meta["train_config"]
    changed = sorted(k for k in new if old.get(k) != new[k] and k not in _RESUMABLE_CHANGES)
    if changed:
        raise TrainError(
            f"checkpoint {found.path} was trained with other settings ({', '.join('train.' + k for k in changed)}); "
            "restore them to resume, or use a fresh out_dir"
        )


def _save(run: _Run, out_dir: Path) -> Path:
    state = {
        "optimizer": run.optimizer.state_dict(),
        "scheduler": {"kind": "warmup_cosine", "last_step": run.step},
        "rng": {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        "data": {"epoch": run.epoch, "cursor": run.cursor},
        "tokens_seen": run.tokens_seen,
    }
    return save_checkpoint(out_dir / CHECKPOINTS, run.step, run.model.state_dict(), state, run.meta)


def _train_step(run: _Run) -> tuple[float, list[float], float]:
    """One optimizer step over grad_accum micro-batches: (loss, per-TTT-step losses, lr)."""
    config = run.config
    lr = lr_at(run.step, config)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.zero_grad(set_to_none=True)
    total, per_step = 0.0, [0.0] * config.ttt_steps
    for _ in range(config.grad_accum):
        indices, run.epoch, run.cursor = next_batch_indices(
            run.lengths, config.seed, run.epoch, run.cursor, config.batch_tokens
        )
        batch = _to_device(pack([run.reader[i] for i in indices], config.ttt_steps, config.batch_tokens), run)
        with torch.autocast(device_type=run.device.type, dtype=torch.bfloat16, enabled=run.autocast):
            loss, losses = batch_loss(run.model, batch, run.head, run.draft_rows)
        (loss / config.grad_accum).backward()
        total += loss.item() / config.grad_accum
        per_step = [a + b.item() / config.grad_accum for a, b in zip(per_step, losses, strict=True)]
        run.tokens_seen += batch.num_tokens
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), config.max_grad_norm)
    run.optimizer.step()
    run.step += 1
    return total, per_step, lr


def _to_device(batch: MicroBatch, run: _Run) -> MicroBatch:
    dtype = torch.bfloat16 if run.autocast else torch.float32
    moved = {k: getattr(batch, k).to(run.device) for k in MicroBatch.__dataclass_fields__}
    moved["aux"], moved["final"] = moved["aux"].to(dtype), moved["final"].to(dtype)
    return MicroBatch(**moved)


def _read_losses(path: Path, up_to: int) -> list[dict]:
    """Entries of losses.jsonl for steps <= up_to (later ones belong to a lost trajectory)."""
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    entries = []
    for number, line in enumerate(lines):
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number != len(lines) - 1:
                raise TrainError(
                    f"{path} line {number + 1} is not JSON; delete the file to start its log afresh"
                ) from err
            log.warning("dropping the half-written last line of %s (the run was killed while logging)", path)
    return [e for e in entries if e["step"] <= up_to]


def train_draft(
    config: TrainConfig,
    *,
    store_dir: Path,
    target_dir: Path,
    head_path: Path,
    vocab_path: Path,
    out_dir: Path,
    progress: Callable[[int, int, float], None] | None = None,
    stop_after: int | None = None,
) -> TrainResult:
    """Train (or resume training) the draft; checkpoints and losses.jsonl go under out_dir.

    `stop_after` ends the call once the trajectory reaches that step, writing no extra
    checkpoint: it behaves like an interruption (tests use it to check resume).
    """
    started = time.monotonic()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    previous_determinism = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        run = _setup(config, Path(store_dir), Path(target_dir), Path(head_path), Path(vocab_path))
        resumed = _resume(run, out_dir)
        history = _read_losses(out_dir / LOSSES, run.step)
        _write_losses(out_dir / LOSSES, history)
        last = None if resumed is None else out_dir / CHECKPOINTS / f"step-{resumed:06d}"
        end = config.steps if stop_after is None else min(config.steps, stop_after)
        with open(out_dir / LOSSES, "a") as losses_file:
            while run.step < end:
                loss, per_step, lr = _train_step(run)
                entry = {"step": run.step, "loss": loss, "loss_per_ttt_step": per_step, "lr": lr,
                         "tokens_seen": run.tokens_seen}
                history.append(entry)
                losses_file.write(json.dumps(entry) + "\n")
                losses_file.flush()
                if progress is not None:
                    progress(run.step, config.steps, loss)
                if run.step % config.checkpoint_every == 0 or run.step == config.steps:
                    last = _save(run, out_dir)
    finally:
        torch.use_deterministic_algorithms(previous_determinism)
    return TrainResult(
        checkpoint=last,
        steps_done=run.step,
        losses=[e["loss"] for e in history],
        tokens_seen=run.tokens_seen,
        seconds=time.monotonic() - started,
        resumed_from_step=resumed,
    )


def _write_losses(path: Path, entries: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(e) + "\n" for e in entries))
