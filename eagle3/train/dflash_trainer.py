"""Training a DFlash draft (train.draft.method: dflash; eagle3.draft.dflash) from the captured store or online.

The same inputs as the EAGLE-3 trainer: the samples (token ids, loss mask, the target's states at the aux layers)
and the target's embedding and lm_head (target_head). DFlash reads the aux states as its target_layer_ids (aux id a
is the output of layer a - 1: eagle3.draft.dflash). Each optimizer step takes train.grad_accum micro-batches in the
EAGLE-3 trainer's order (next_batch_indices: whole samples, each cut to train.batch_tokens, up to train.batch_tokens
tokens a micro-batch, a seeded permutation per epoch). With train.data online or hybrid the same micro-batches
come from the online feed (eagle3.online.feed: the target's engine, or a capture worker, writes each micro-batch's
states into the buffer as the trainer goes; hybrid keeps the first samples' states in the store), so online, hybrid
and store runs train the same draft. Each step samples train.draft.anchors_per_sample random anchors in each sample
(sample_blocks) and minimises the paper's decay-weighted cross-entropy (dflash_loss), with train.optimizer (AdamW,
or Muon on the hidden matrices as the EAGLE-3 trainer does: eagle3.train.optim) at lr_at(step) (train.learning_rate,
warm-up, cosine) and gradients clipped to train.max_grad_norm. Each sample is read from its
shard when drawn (dflash_eval.StoreRows, or the buffer's shard, deleted once read), so memory does not grow with the
data.

Every train.checkpoint_every steps (and at the last) a checkpoint folder `checkpoints/step-NNNNNN` holds the weights
(draft.safetensors), the DFlash shape (dflash_config.json) and the optimizer (optimizer.pt); it appears whole or
not at all. A killed run resumes from its last checkpoint and takes the same samples and anchors from there, since
both follow from (train.seed, the data order's (epoch, cursor), the samples drawn so far); online, the feed starts
again at that cursor. With a held-out store each checkpoint is scored there
(evals.jsonl): the acceptance length a chain verifier gives a block, 1 + the drafted slots that match the data
before the first miss, averaged over held-out blocks at fixed anchors, and the walk
(eagle3.evaluate.dflash_eval.heldout_figures: drafting where a served greedy run drafts), by which
train.select best picks. The data are the target's own answers (the regenerate stage), so these estimate what vLLM
accepts; the served evaluation measures it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3.artifacts import fsync_path, remove_write_temporaries
from eagle3.capture.store import StoreReader, read_shard_sample
from eagle3.draft.batches import next_batch_indices
from eagle3.draft.checkpoint import checkpoint_name, clean_temporaries
from eagle3.draft.dflash import (
    DFlashConfig,
    DFlashDraft,
    DFlashSettings,
    block_logits,
    dflash_loss,
    init_dflash,
)
from eagle3.draft.dflash_export import load_exported_dflash
from eagle3.draft.export import ExportError
from eagle3.draft.settings import DraftSettings
from eagle3.draft.target_head import TargetHead, load_target_head, read_target_config
from eagle3.evaluate.dflash_eval import (
    StoreRows,
    as_row,
    blocks_for,
    heldout_figures,
)
from eagle3.online.feed import OnlineData, OnlineFeed
from eagle3.online.remote import RemoteFeed
from eagle3.train.config import TrainConfig, TrainError, lr_at
from eagle3.train.optim import MuonWithAdamW, build_optimizer
from eagle3.train.trainer import (
    EVALS,
    LOSSES,
    TrainResult,
    _read_jsonl,
    _write_jsonl,
    best_eval,
)

WEIGHTS, SHAPE, OPTIMIZER = "draft.safetensors", "dflash_config.json", "optimizer.pt"


def dflash_config_for(settings: DraftSettings, target_dir: Path, aux_layer_ids: list[int]) -> DFlashConfig:
    """The DFlash draft's shape: the target's layers with train.draft's DFlash settings, reading the captured aux
    layers (aux id a: the output of target layer a - 1)."""
    if settings.mask_token_id is None:
        raise TrainError("train.draft.mask_token_id is unset; the DFlash draft needs it (docs/dflash.md)")
    if 0 in aux_layer_ids:
        raise TrainError(f"the store's aux layers {aux_layer_ids} include 0 (the embedding), which DFlash cannot "
                         "read (it fuses layer outputs); set extract.aux_layer_ids to layers >= 1")
    dflash = DFlashSettings(block_size=settings.block_size, num_layers=settings.num_layers,
                            mask_token_id=settings.mask_token_id, decay_gamma=settings.gamma())
    try:
        return DFlashConfig.from_target(read_target_config(target_dir), dflash, aux_layer_ids=list(aux_layer_ids))
    except ValueError as err:
        raise TrainError(str(err)) from None


def load_dflash_checkpoint(path: Path) -> DFlashDraft:
    """A checkpoint folder's draft, float32, eval mode."""
    config = DFlashConfig.model_validate_json((path / SHAPE).read_text())
    model = DFlashDraft(config)
    model.load_state_dict(load_file(str(path / WEIGHTS)))
    return model.eval()


def is_dflash_checkpoint(path: Path) -> bool:
    return (Path(path) / SHAPE).is_file()


def _samples(store_dir: Path) -> StoreRows:
    """The store's samples, each read from its shard when drawn (StoreRows: the trainer never holds the store)."""
    rows = StoreRows(StoreReader(store_dir))
    if not len(rows):
        raise TrainError(f"the store {store_dir} holds no samples to train the DFlash draft on")
    return rows


class _Batches:
    """The micro-batches in next_batch_indices' order from (epoch, cursor), as rows (token ids, loss mask, aux states
    float32 [T, n, H]) cut to `batch_tokens`: from the store, or from the online feed (each micro-batch's shard read,
    then consumed: deleted from the buffer)."""

    def __init__(self, rows: StoreRows | None, feed: OnlineFeed | RemoteFeed | None, lengths: list[int], n_aux: int,
                 seed: int, batch_tokens: int, epoch: int, cursor: int) -> None:
        self.rows, self.feed, self.lengths, self.n_aux = rows, feed, lengths, n_aux
        self.seed, self.batch_tokens, self.epoch, self.cursor, self.k = seed, batch_tokens, epoch, cursor, 0

    def next(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        indices, self.epoch, self.cursor = next_batch_indices(self.lengths, self.seed, self.epoch, self.cursor,
                                                              self.batch_tokens)
        if self.feed is None:
            rows = [self.rows[i] for i in indices]
        else:  # micro-batch k of the feed's stream: the same indices, captured (or kept) in the buffer's shards
            where = self.feed.locations(self.k, indices)
            rows = [self._read(*where[i]) for i in indices]
            self.feed.consumed(self.k)
        self.k += 1
        cut = self.batch_tokens
        return [(ids[:cut], mask[:cut], aux[:cut]) for ids, mask, aux in rows]

    def _read(self, path: str, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return as_row(*read_shard_sample(Path(path), j), self.n_aux)  # as StoreRows reads a store's


def _save(model: DFlashDraft, optimizer: torch.optim.Optimizer | MuonWithAdamW, out_dir: Path, step: int,
          position: dict[str, int]) -> Path:
    final = out_dir / "checkpoints" / checkpoint_name(step)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")  # clean_temporaries' pattern
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().float().contiguous().cpu() for k, v in model.state_dict().items()}, str(tmp / WEIGHTS),
              metadata={"format": "pt"})
    (tmp / SHAPE).write_text(model.config.model_dump_json(indent=1))
    torch.save({"optimizer": optimizer.state_dict(), "step": step} | position, tmp / OPTIMIZER)
    for path in (tmp / WEIGHTS, tmp / SHAPE, tmp / OPTIMIZER, tmp):
        fsync_path(path)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def _warm_start(model: DFlashDraft, init_from: Path) -> None:
    """Load an exported DFlash draft's weights into the freshly built `model` (same shape and DFlash settings)."""
    try:
        parent = load_exported_dflash(init_from)
    except (OSError, KeyError, ValueError, ExportError) as err:
        raise TrainError(f"train init_from={init_from}: not a readable exported DFlash draft ({err}); point it at a "
                         "DFlash export folder (config.json + model.safetensors), or set warm_start: false") from err
    if parent.config != model.config:
        ours, theirs = model.config.model_dump(), parent.config.model_dump()
        changed = sorted(k for k, v in ours.items() if theirs.get(k) != v)
        raise TrainError(f"train init_from={init_from}: the DFlash draft there differs from this run's in "
                         f"{', '.join(changed)}; warm starts need the same target and train.draft settings, or set "
                         "warm_start: false")
    model.load_state_dict(parent.state_dict())


def _latest(out_dir: Path) -> Path | None:
    folders = sorted(p for p in (out_dir / "checkpoints").glob("step-*") if (p / OPTIMIZER).is_file())
    return folders[-1] if folders else None


def train_dflash(config: TrainConfig, *, store_dir: Path, target_dir: Path, head_path: Path, out_dir: Path,
                 progress: Callable[..., None] | None = None, stop_after: int | None = None,
                 heldout_store_dir: Path | None = None, init_from: Path | None = None,
                 online: OnlineData | None = None) -> TrainResult:
    """Train (or resume) the DFlash draft; checkpoints, losses.jsonl and evals.jsonl under out_dir (module
    docstring). `progress(step, steps, loss)` after every step; `stop_after` ends the call at that step, as an
    interruption would (tests check resume with it). `init_from`: an exported DFlash draft of the same shape whose
    weights a fresh run starts from (the nightly warm start); a resumed run takes its checkpoint's instead.
    `online`: train.data online/hybrid (eagle3.online.feed): the samples, captured as the trainer goes; `store_dir`
    is then unused (the kept samples' store is in `online`). `progress` then also gets the tokens captured so far."""
    started = time.monotonic()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_temporaries(out_dir / "checkpoints")  # what a killed run left: half-written checkpoints and log rewrites
    remove_write_temporaries(out_dir, (LOSSES, EVALS))
    if online is None:
        rows = _samples(Path(store_dir))
        aux_layer_ids, lengths = rows.reader.aux_layer_ids, rows.lengths
    else:
        rows, aux_layer_ids, lengths = None, list(online.aux_layer_ids), [s.tokens for s in online.samples]
        if not lengths:
            raise TrainError("the online data hold no samples to train the DFlash draft on")
    dconfig = dflash_config_for(config.draft, Path(target_dir), aux_layer_ids)
    head: TargetHead = load_target_head(Path(head_path), read_target_config(Path(target_dir)))
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")  # train.devices' first GPU
    embed = head.embed.float().to(device)
    heldout = _samples(Path(heldout_store_dir)) if heldout_store_dir is not None else None
    model = DFlashDraft(dconfig)
    init_dflash(model, head, seed=config.seed)
    if init_from is not None and _latest(out_dir) is None:
        _warm_start(model, Path(init_from))
    model.to(device)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # the lm_head is the target's, frozen
    params = [p for _, p in named]
    optimizer = build_optimizer(config.optimizer, [n for n, _ in named], params, config.learning_rate,
                                config.weight_decay, fused=False)
    step, resumed, drawn = 0, None, 0  # drawn: samples taken so far (they seed each sample's anchors)
    epoch = cursor = 0  # the data order's position (next_batch_indices)
    last = _latest(out_dir)
    if last is not None:
        saved = DFlashConfig.model_validate_json((last / SHAPE).read_text())
        if saved != dconfig:
            raise TrainError(f"{last} holds a DFlash draft of another shape ({saved}); this run's settings give "
                             f"{dconfig}: delete {out_dir} to start over")
        model.load_state_dict(load_file(str(last / WEIGHTS), device=str(device)))
        state = torch.load(last / OPTIMIZER, weights_only=True, map_location=device)
        optimizer.load_state_dict(state["optimizer"])
        step = resumed = int(state["step"])
        drawn, epoch, cursor = int(state["drawn"]), int(state["epoch"]), int(state["cursor"])
    history, evals = _read_jsonl(out_dir / LOSSES, step), _read_jsonl(out_dir / EVALS, step)
    _write_jsonl(out_dir / LOSSES, history)
    _write_jsonl(out_dir / EVALS, evals)

    def evaluate(at: int) -> None:
        if heldout is not None and not any(e["step"] == at for e in evals):
            model.eval()
            evals.append({"step": at, "checkpoint": checkpoint_name(at)} | heldout_figures(
                model, embed, heldout, config.draft.anchors_per_sample))
            model.train()
            _write_jsonl(out_dir / EVALS, evals)

    if resumed is not None:
        evaluate(resumed)  # killed between writing the checkpoint and scoring it
    end = config.steps if stop_after is None else min(config.steps, stop_after)
    tokens_seen = sum(int(e.get("tokens", 0)) for e in history)
    feed = None
    if online is not None and step < end:  # online.producer: a thread here, or a capture worker's files
        feed = (RemoteFeed if online.producer == "remote" else OnlineFeed)(
            online, lengths, config.seed, config.batch_tokens, epoch, cursor)
    batches = _Batches(rows, feed, lengths, len(aux_layer_ids), config.seed, config.batch_tokens, epoch, cursor)
    model.train()
    try:
        while step < end:
            lr = lr_at(step, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            model.zero_grad(set_to_none=True)
            step_rows = [row for _ in range(config.grad_accum) for row in batches.next()]
            total, tokens = 0.0, 0
            for row in step_rows:
                generator = torch.Generator().manual_seed((config.seed + 1) * 7_919 + drawn)
                blocks, aux = blocks_for(row, dconfig, config.draft.anchors_per_sample, generator, device)
                loss = dflash_loss(block_logits(model, aux, embed, blocks), blocks) / len(step_rows)
                loss.backward()
                total += float(loss.detach())
                tokens += int(row[0].numel())
                drawn += 1
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            optimizer.step()
            step += 1
            tokens_seen += tokens
            entry = {"step": step, "loss": total, "lr": lr, "tokens": tokens, "tokens_seen": tokens_seen}
            history.append(entry)
            with open(out_dir / LOSSES, "a") as losses:
                losses.write(json.dumps(entry) + "\n")
            if progress is not None:
                progress(step, config.steps, total, *([feed.stats()["tokens_captured"]] if feed is not None else []))
            if step % config.checkpoint_every == 0 or step == config.steps:
                last = _save(model, optimizer, out_dir, step,
                             {"drawn": drawn, "epoch": batches.epoch, "cursor": batches.cursor})
                evaluate(step)
    finally:
        if feed is not None:
            feed.close()  # nothing of the buffer outlives the call
    best = best_eval(evals) if config.select == "best" and evals else None
    return TrainResult(checkpoint=last, steps_done=step, losses=[e["loss"] for e in history],
                       tokens_seen=tokens_seen, seconds=time.monotonic() - started, resumed_from_step=resumed,
                       best_checkpoint=out_dir / "checkpoints" / best["checkpoint"] if best else last, evals=evals,
                       online=feed.stats() if feed is not None else {})
