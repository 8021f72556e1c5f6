"""Training the EAGLE-3 draft on stored hidden states, with TTT, checkpoints and resume.

Loss: eagle3.train.loss (KL(target || draft) over the draft vocabulary, per TTT step, mean over
steps). AdamW, or Muon with AdamW (eagle3.train.optim); linear warm-up, cosine decay.

Data: eagle3.draft.batches packs whole samples into micro-batches of at most `batch_tokens` tokens
in a seeded per-epoch order. The data position (epoch, cursor) is part of every checkpoint,
so a resumed run sees exactly the batches the uninterrupted run would have seen. Batches are
read and packed ahead by a small thread pool (and copied to the GPU on a side stream), in the
same order, so the device never waits for the disk while the trajectory stays the same.

Warm start: `init_from` (an exported draft folder, e.g. the draft in service) replaces the
fresh initial weights; its shape and vocabulary mapping must be this run's. A resumed run
takes its checkpoint's weights, whatever `init_from` says.

Checkpoints are scored on the held-out store (when given), logged to evals.jsonl: simulated
acceptance at every position, and the walk (eagle3.evaluate.acceptance: the positions a served greedy
run drafts at, what vLLM's counters measure). The best by the walk is kept through pruning and
named in the result: with train.select='best' (the default) the export takes it, not the last one
(acceptance can peak mid-training, or fall after a bad step).

Data parallel (torchrun): see eagle3.train.ddp; rank 0 writes checkpoints and logs.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from eagle3.artifacts import atomic_write_text, remove_write_temporaries
from eagle3.capture.store import StoreReader
from eagle3.train import ddp
from eagle3.draft.batches import BatchStream
from eagle3.draft.checkpoint import Checkpoint, checkpoint_name, clean_temporaries, latest_valid_checkpoint, save_checkpoint
from eagle3.evaluate.acceptance import simulate_acceptance
from eagle3.draft.export import ExportError, load_exported_draft
from eagle3.train.loss import EAGER, LossKernels, batch_loss, compiled_kernels
from eagle3.draft.architecture import (DraftArchitectureError, DraftSettings, build_draft, draft_config_for,
                                      draft_config_from_dict, read_text_config, resolve)
from eagle3.draft.model import Eagle3Draft, init_draft
from eagle3.online.feed import OnlineData, OnlineFeed
from eagle3.online.remote import RemoteFeed
from eagle3.train.optim import MuonWithAdamW, build_optimizer
from eagle3.draft.target_head import TargetHead, load_target_head, read_target_config
# the settings live in eagle3.train.config; imported from here too
from eagle3.train.config import (ADDED_WITH_DEFAULT, RUNTIME_ONLY, TrainConfig, TrainError,  # noqa: F401
                                       _RESUMABLE_CHANGES, lr_at, with_effective_grad_accum)
from eagle3.draft.vocab import VocabMapping, load_mapping

log = logging.getLogger(__name__)

LOSSES = "losses.jsonl"
EVALS = "evals.jsonl"
CHECKPOINTS = "checkpoints"
@dataclass(frozen=True)
class TrainResult:
    """What a call of train_draft did. `losses` is the whole trajectory, resumed steps included."""

    checkpoint: Path | None
    steps_done: int
    losses: list[float]
    tokens_seen: int
    seconds: float
    resumed_from_step: int | None
    best_checkpoint: Path | None = None  # highest held-out acceptance; the last checkpoint without a held-out store
    evals: list[dict] = field(default_factory=list)  # evals.jsonl: step, acceptance_length, per_position, checkpoint
    online: dict[str, float] = field(default_factory=dict)  # train.data online/hybrid: tokens_captured, capture_seconds, buffer_peak_bytes


@dataclass
class _Run:
    """Everything train_draft holds between steps."""

    config: TrainConfig
    locations: list[tuple[str, int]]  # sample i of the store: (shard path, position in the shard)
    lengths: list[int]  # tokens of sample i
    model: Eagle3Draft
    optimizer: torch.optim.Optimizer | MuonWithAdamW
    head: TargetHead  # its lm_head holds only the draft vocabulary's rows
    mapping: VocabMapping
    device: torch.device
    autocast: bool
    meta: dict[str, object]
    ctx: ddp.DistContext
    master: list[torch.Tensor] | None = None  # fp32 copies of model.parameters() when the model holds bf16
    kernels: LossKernels = EAGER  # compiled_kernels() with train.compile
    online: OnlineData | None = None  # train.data online/hybrid: the samples captured as the trainer goes
    open_feed: Callable[[], OnlineFeed | RemoteFeed] | None = None  # the BatchStream's feed, from (epoch, cursor) at its start
    feeds: list[OnlineFeed | RemoteFeed] = field(default_factory=list)  # every feed opened (their figures go into the result)
    greedy_cache: dict[str, torch.Tensor] = field(default_factory=dict)  # held-out scoring: the target's greedy tokens
    step: int = 0
    epoch: int = 0
    cursor: int = 0
    tokens_seen: int = 0


class _Layout:
    """What the trainer reads of its data before training: aux ids, hidden size, and where each sample is."""

    def __init__(self, store_dir: Path, online: OnlineData | None) -> None:
        if online is None:
            reader = StoreReader(store_dir)
            self.aux_layer_ids, self.hidden_size = reader.aux_layer_ids, reader.hidden_size
            self.locations = [(str(reader.root / e.file), j) for e in reader.shards for j in range(len(e.sample_ids))]
            self.lengths = reader.sample_lengths()
        else:  # online/hybrid: the feed says where each micro-batch's samples are once captured
            self.aux_layer_ids, self.hidden_size = list(online.aux_layer_ids), online.hidden_size
            self.locations, self.lengths = [], [s.tokens for s in online.samples]  # images expanded

    def __len__(self) -> int:
        return len(self.lengths)


def _setup(config: TrainConfig, store_dir: Path, target_dir: Path, head_path: Path, vocab_path: Path,
           init_from: Path | None, online: OnlineData | None = None) -> _Run:
    ctx = ddp.context_from_env()
    config = with_effective_grad_accum(config, ddp.device_for(ctx).type == "cuda", ctx.world_size)  # tokens_per_step
    ddp.check_grad_accum(config.grad_accum, ctx)
    if online is not None and ctx.world_size > 1:
        raise TrainError(f"train.data={config.data!r} with {ctx.world_size} training processes: online data feeds one "
                         "process for now; set train.num_processes=1 and train.nnodes=1, or train.data='store'")
    reader = _Layout(store_dir, online)
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
    try:  # train.draft: auto resolved by the target's config; deepseek_mla on a non-MLA target refused
        draft_config = draft_config_for(config.draft, target_dir, num_aux_hidden_states=len(reader.aux_layer_ids),
                                        draft_vocab_size=mapping.draft_vocab_size)
    except DraftArchitectureError as err:
        raise TrainError(str(err)) from None
    device = ddp.device_for(ctx)
    bf16 = config.dtype == "bfloat16" or (config.dtype == "auto" and device.type == "cuda")
    full_head = load_target_head(head_path, target)
    model = build_draft(draft_config)
    init_draft(model, full_head, mapping, config.seed)
    if init_from is not None:
        _warm_start(model, mapping, Path(init_from))
    model.to(device)
    master = None
    if config.param_dtype == "bfloat16" or (config.param_dtype == "auto" and bf16):
        master = [p.detach().clone() for p in model.parameters()]  # fp32: what the optimizer updates
        model.to(torch.bfloat16)
    compile_on = config.compile if config.compile is not None else device.type == "cuda"
    if compile_on:
        _allow_graphs(config.ttt_steps)
        model.step = torch.compile(model.step, dynamic=True)  # a graph per TTT step; the optimizer stays eager
    # Only the draft vocabulary's rows of the target's lm_head are ever used in training.
    head = replace(full_head, lm_head=full_head.lm_head[mapping.target_ids]).to(
        torch.bfloat16 if bf16 else torch.float32, device)
    updated = list(model.parameters()) if master is None else master
    names = [n for n, _ in model.named_parameters()]
    optimizer = build_optimizer(config.optimizer, names, updated, config.learning_rate, config.weight_decay,
                                fused=device.type == "cuda")
    settings = config.model_dump() | {"draft": resolve(config.draft, read_text_config(target_dir)).model_dump()}
    meta = {"train_config": settings, "draft_config": draft_config.model_dump(),
            "aux_layer_ids": reader.aux_layer_ids, "num_samples": len(reader),
            "init_from": None if init_from is None else str(init_from)}
    locations, lengths = reader.locations, reader.lengths
    if too_long := sum(length > config.batch_tokens for length in lengths):
        log.warning("%d of %d samples are longer than train.batch_tokens=%d; they are cut to that length",
                    too_long, len(lengths), config.batch_tokens)
    run = _Run(config, locations, lengths, model, optimizer, head, mapping, device, bf16, meta, ctx, master,
               compiled_kernels() if compile_on else EAGER, online)
    if online is not None:
        def open_feed() -> OnlineFeed | RemoteFeed:  # online.producer: a thread here, or a capture worker's files
            kind = RemoteFeed if online.producer == "remote" else OnlineFeed
            run.feeds.append(kind(online, run.lengths, config.seed, config.batch_tokens, run.epoch, run.cursor))
            return run.feeds[-1]

        run.open_feed = open_feed
    return run


def _allow_graphs(ttt_steps: int) -> None:
    """Let torch.compile keep every graph of the step: one per TTT step (its own keys' count differs), each with
    and without a document mask, for every model built in this process (the cache belongs to the code, not the
    instance). Past dynamo's limit (8) it would silently run the rest eagerly."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * 2 * ttt_steps)


def _compile_errors() -> tuple[type[BaseException], ...]:
    """What torch.compile raises when it cannot compile (dynamo's errors, Inductor's)."""
    import torch._dynamo.exc

    errors: list[type[BaseException]] = [torch._dynamo.exc.TorchDynamoException]
    inductor = getattr(importlib.import_module("torch._inductor.exc"), "InductorError", None)
    return (*errors, inductor) if inductor is not None else tuple(errors)


def _warm_start(model: Eagle3Draft, mapping: VocabMapping, init_from: Path) -> None:
    """Load an exported draft's weights into the freshly built `model` (same shape, same d2t/t2d)."""
    try:
        parent, parent_mapping = load_exported_draft(init_from)
    except (OSError, KeyError, ValueError, ExportError) as err:
        raise TrainError(f"train init_from={init_from}: not a readable exported draft ({err}); point it at an "
                         "export folder (config.json + model.safetensors) or start from scratch") from err
    if parent.config != model.config:
        changed = sorted(k for k, v in model.config.model_dump().items() if parent.config.model_dump().get(k) != v)
        raise TrainError(f"train init_from={init_from}: the draft there differs from this run's in "
                         f"{', '.join(changed)}; warm starts need the same target, aux layers, draft vocabulary and draft shape "
                         "(train.draft)")
    if not (torch.equal(parent_mapping.d2t, mapping.d2t) and torch.equal(parent_mapping.t2d, mapping.t2d)):
        raise TrainError(f"train init_from={init_from}: its vocabulary mapping (d2t/t2d) is not this run's; its "
                         "lm_head rows belong to other tokens. Train with the parent's vocab.safetensors")
    model.load_state_dict(parent.state_dict())


def _train_step(run: _Run, stream: BatchStream) -> tuple[float, list[float], float]:
    """One optimizer step over grad_accum micro-batches: (loss, per-TTT-step losses, lr)."""
    config = run.config
    lr = lr_at(run.step, config)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.model.zero_grad(set_to_none=True)
    sums = torch.zeros(1 + config.ttt_steps, dtype=torch.float64, device=run.device)  # [loss, per-step...]
    for micro in range(config.grad_accum):  # the micro-batch's index in the step, the same on every rank
        batch, tokens, one_doc = stream.take()
        run.tokens_seen += tokens
        if batch is None:
            continue
        noise = None
        if config.feature_noise > 0:  # seeded by (seed, step, micro-batch): resumes and DDP draw what a straight run does
            generator = torch.Generator(device=run.device)
            generator.manual_seed(hash((config.seed, run.step, micro)) & 0xFFFF_FFFF_FFFF)
            noise = (config.feature_noise, generator)
        try:
            with torch.autocast(device_type=run.device.type, dtype=torch.bfloat16, enabled=run.autocast):
                loss, losses = batch_loss(run.model, batch, run.head, one_doc, run.kernels, config.ttt_loss_decay,
                                          noise)
            (loss / config.grad_accum).backward()
        except _compile_errors() as err:
            if run.kernels is EAGER:
                raise
            inner = getattr(err, "inner_exception", None) or err.__cause__  # what the compiler itself raised
            lines = [line for line in str(err).splitlines() if line.strip()][:2]
            detail = f"{type(err).__name__}, from {type(inner).__name__}: {inner}" if inner else " ".join(lines)
            raise TrainError(f"torch.compile failed on the draft's training step ({detail[:400]}); "
                             "set train.compile=false to train eagerly (slower on GPUs), or repair the compiler "
                             "setup (Triton, a C++ compiler)") from err
        sums += torch.stack([loss.detach(), *[x.detach() for x in losses]]).double() / config.grad_accum
    ddp.sum_gradients(run.model.parameters(), run.ctx)
    updated = list(run.model.parameters()) if run.master is None else run.master
    if run.master is not None:  # bf16 gradients -> the fp32 master copy, which the optimizer updates
        for master, param in zip(run.master, run.model.parameters(), strict=True):
            master.grad = None if param.grad is None else param.grad.float()
    torch.nn.utils.clip_grad_norm_(updated, config.max_grad_norm)
    run.optimizer.step()
    if run.master is not None:
        with torch.no_grad():
            for master, param in zip(run.master, run.model.parameters(), strict=True):
                param.copy_(master)
                master.grad = None
    run.step += 1
    values = ddp.sum_values(sums, run.ctx).tolist()  # one host sync per step
    return values[0], values[1:], lr


def _resume(run: _Run, out_dir: Path) -> int | None:
    """Load the newest valid checkpoint into `run`; returns its step (None when starting fresh)."""
    if run.ctx.is_main:  # a killed run's leftovers: checkpoint folders, and the logs' rewrites (_write_jsonl)
        clean_temporaries(out_dir / CHECKPOINTS)
        remove_write_temporaries(out_dir, (LOSSES, EVALS))
    ddp.barrier(run.ctx)
    found: Checkpoint | None = latest_valid_checkpoint(out_dir / CHECKPOINTS)
    low, high = ddp.spread(-1 if found is None else found.step, run.ctx)
    if low != high:  # a machine that sees another out_dir would train from other weights
        raise TrainError(f"the training processes found different checkpoints in {out_dir / CHECKPOINTS} (steps "
                         f"{low} and {high}, -1: none): with train.nnodes > 1 every machine must see the artifacts "
                         "folder as one shared folder, at the same path")
    if found is None:
        return None
    _check_compatible(found, run)
    run.model.load_state_dict(found.weights)
    if run.master is not None:
        for (name, _), master in zip(run.model.named_parameters(), run.master, strict=True):
            master.copy_(found.weights[name])
    state = found.state
    run.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["cpu"])
    if torch.cuda.is_available() and state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    run.step, run.epoch, run.cursor = found.step, int(state["data"]["epoch"]), int(state["data"]["cursor"])
    run.tokens_seen = int(state["tokens_seen"])
    return found.step


def _check_compatible(found: Checkpoint, run: _Run) -> None:
    found_meta = dict(found.meta)
    if found_meta.get("draft_config") is not None:  # a checkpoint from before a shape field existed: its default
        found_meta["draft_config"] = draft_config_from_dict(found_meta["draft_config"]).model_dump()
    for key in ("draft_config", "aux_layer_ids", "num_samples"):
        if found_meta.get(key) != run.meta[key]:
            raise TrainError(
                f"checkpoint {found.path} has {key} {found.meta.get(key)}, this run {run.meta[key]}: it was "
                "trained on other data or another draft shape; use a fresh out_dir"
            )
    old, new = found.meta.get("train_config", {}), run.meta["train_config"]
    old = {**ADDED_WITH_DEFAULT, **old}  # a checkpoint from before a setting existed trained at its default
    old["draft"] = DraftSettings(**old["draft"]).model_dump()  # likewise a train.draft field (num_layers)
    changed = sorted(k for k in new if old.get(k) != new[k] and k not in _RESUMABLE_CHANGES)
    if changed:
        raise TrainError(
            f"checkpoint {found.path} was trained with other settings ({', '.join('train.' + k for k in changed)}); "
            "restore them to resume, or use a fresh out_dir"
        )


def _save(run: _Run, out_dir: Path, protect: set[str]) -> Path:
    state = {
        "optimizer": run.optimizer.state_dict(),
        "scheduler": {"kind": "warmup_cosine", "last_step": run.step},
        "rng": {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        "data": {"epoch": run.epoch, "cursor": run.cursor},
        "tokens_seen": run.tokens_seen,
    }
    return save_checkpoint(out_dir / CHECKPOINTS, run.step, _weights(run), state, run.meta, protect=protect)


def _weights(run: _Run) -> dict[str, torch.Tensor]:
    """The draft's weights at full precision: the fp32 master copy when the model holds bf16."""
    state = run.model.state_dict()
    if run.master is not None:
        names = [name for name, _ in run.model.named_parameters()]
        state.update(zip(names, run.master, strict=True))
    return state


def _evaluate(run: _Run, heldout: Path, head: TargetHead) -> dict:
    """Simulated acceptance of the current weights on the held-out store (one evals.jsonl entry)."""
    model = run.model
    if run.master is not None:  # scored in fp32, as the export will be
        model = build_draft(run.model.config).to(run.device)
        model.load_state_dict(_weights(run))
    report = simulate_acceptance((model, run.mapping), heldout, head, run.config.num_draft_tokens_eval,
                                 greedy_cache=run.greedy_cache, verify=False)  # verified once, in _loop
    return {"step": run.step, "checkpoint": checkpoint_name(run.step), "acceptance_length": report.acceptance_length,
            "per_position": report.per_position, "num_drafts": report.num_drafts,
            "walk": report.served_acceptance_length}


def best_eval(evals: list[dict]) -> dict | None:
    """The entry with the highest walk (the later one on a tie); by simulated acceptance when an entry has no walk
    (evals.jsonl written before the walk was logged)."""
    key = "walk" if all("walk" in e for e in evals) else "acceptance_length"
    return max(reversed(evals), key=lambda e: e[key], default=None)


def _read_jsonl(path: Path, up_to: int) -> list[dict]:
    """Entries of a log (losses.jsonl, evals.jsonl) for steps <= up_to (later ones belong to a lost trajectory)."""
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


def _write_jsonl(path: Path, entries: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(e) + "\n" for e in entries))


def train_draft(
    config: TrainConfig,
    *,
    store_dir: Path,
    target_dir: Path,
    head_path: Path,
    vocab_path: Path,
    out_dir: Path,
    progress: Callable[..., None] | None = None,
    stop_after: int | None = None,
    heldout_store_dir: Path | None = None,
    init_from: Path | None = None,
    online: OnlineData | None = None,
) -> TrainResult:
    """Train (or resume training) the draft; checkpoints, losses.jsonl and evals.jsonl go under out_dir.

    `progress(step, steps, loss)` after every step; with `online`, `progress(step, steps, loss, tokens captured so
    far)` (by this process's producer or, online.producer='remote', by the workers whose shards it read).
    `stop_after` ends the call once the trajectory reaches that step, writing no extra
    checkpoint: it behaves like an interruption (tests use it to check resume).
    `heldout_store_dir`: score every checkpoint by simulated acceptance there (see the module docstring).
    `init_from`: an exported draft folder to start from instead of fresh weights (warm start).
    `online`: train.data online/hybrid: the samples and the capture (eagle3.online.feed); `store_dir`
    is then unused (the kept samples' store is in `online`).
    """
    started = time.monotonic()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    previous_determinism = torch.are_deterministic_algorithms_enabled()
    deterministic = config.deterministic if config.deterministic is not None else not torch.cuda.is_available()
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        run = _setup(config, Path(store_dir), Path(target_dir), Path(head_path), Path(vocab_path), init_from, online)
        resumed = _resume(run, out_dir)
        result = _loop(run, out_dir, resumed, progress, stop_after, heldout_store_dir, Path(head_path), target_dir)
    finally:
        torch.use_deterministic_algorithms(previous_determinism)
    return replace(result, seconds=time.monotonic() - started, online=_online_stats(run))


def _online_stats(run: _Run) -> dict[str, float]:
    """The figures of every feed this call opened (tokens captured, capture seconds, peak buffer bytes)."""
    if not run.feeds:
        return {}
    figures = [feed.stats() for feed in run.feeds]
    return {"tokens_captured": sum(f["tokens_captured"] for f in figures),
            "capture_seconds": round(sum(f["capture_seconds"] for f in figures), 3),
            "buffer_peak_bytes": max(f["buffer_peak_bytes"] for f in figures)}


def _loop(run: _Run, out_dir: Path, resumed: int | None, progress: Callable[..., None] | None,
          stop_after: int | None, heldout: Path | None, head_path: Path, target_dir: Path) -> TrainResult:
    config, main = run.config, run.ctx.is_main
    history, evals = _read_jsonl(out_dir / LOSSES, run.step), _read_jsonl(out_dir / EVALS, run.step)
    eval_head = load_target_head(head_path, read_target_config(target_dir)) if heldout is not None else None
    if heldout is not None:
        StoreReader(heldout)  # checks every held-out shard's sha256 once; each scoring then reads unverified
    last = None if resumed is None else out_dir / CHECKPOINTS / checkpoint_name(resumed)

    def evaluate_checkpoint() -> None:
        if main and eval_head is not None:
            evals.append(_evaluate(run, Path(heldout), eval_head))
            _write_jsonl(out_dir / EVALS, evals)

    if main:
        _write_jsonl(out_dir / LOSSES, history)
        _write_jsonl(out_dir / EVALS, evals)
        if resumed is not None and not any(e["step"] == resumed for e in evals):
            evaluate_checkpoint()  # killed between writing this checkpoint and scoring it
    end = config.steps if stop_after is None else min(config.steps, stop_after)
    stream = BatchStream(run) if run.step < end else None
    try:
        with open(out_dir / LOSSES, "a") if main else open(os.devnull, "w") as losses_file:
            while run.step < end:
                loss, per_step, lr = _train_step(run, stream)
                entry = {"step": run.step, "loss": loss, "loss_per_ttt_step": per_step, "lr": lr,
                         "tokens_seen": run.tokens_seen}
                history.append(entry)
                losses_file.write(json.dumps(entry) + "\n")
                losses_file.flush()
                if progress is not None:  # online: and the tokens captured so far, whichever producer captured them
                    progress(run.step, config.steps, loss,
                             *([_online_stats(run).get("tokens_captured", 0)] if run.online is not None else []))
                if run.step % config.checkpoint_every == 0 or run.step == config.steps:
                    best = best_eval(evals)
                    if main:
                        _save(run, out_dir, protect={best["checkpoint"]} if best else set())
                    last = out_dir / CHECKPOINTS / checkpoint_name(run.step)
                    evaluate_checkpoint()
                    ddp.barrier(run.ctx)
    finally:
        if stream is not None:
            stream.close()
    ddp.barrier(run.ctx)
    evals = _read_jsonl(out_dir / EVALS, run.step)  # every process: rank 0 wrote them
    best = best_eval(evals) if config.select == "best" else None
    return TrainResult(
        checkpoint=last, steps_done=run.step, losses=[e["loss"] for e in history], tokens_seen=run.tokens_seen,
        seconds=0.0, resumed_from_step=resumed, evals=evals,
        best_checkpoint=out_dir / CHECKPOINTS / best["checkpoint"] if best else last,
    )
