"""Stage entry points of the draft side: vocab, train, export, evaluate.

Same contract as eagle3.stages: settings + upstream records in, one whole artifact out at
`<artifact_root>/<stage>/<fingerprint>/`, returned without work when already there.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.artifacts import StageRecord, atomic_write_text, building, mark_complete
from eagle3.capture.store import StoreReader
from eagle3.capture.vllm_serving import ServingSetup
from eagle3.data import conversations
from eagle3.data.target import HEAD_FILE, INFO_FILE, TargetInfo
from eagle3.draft.architecture import read_text_config, resolve
from eagle3.evaluate.acceptance import AcceptanceReport, EvalConfig, Progress, SourceFigures, simulate_acceptance
from eagle3.draft.dflash_export import export_dflash, is_dflash
from eagle3.draft.export import export_draft
from eagle3.train.launch import resolve_num_processes, train_distributed
from eagle3.evaluate.plots import (ACCEPTANCE_PNG, LOSS_PNG, SWEEP_PNG, plot_acceptance, plot_served_sweep,
                                  plot_training_loss)
from eagle3.evaluate.dflash_eval import evaluate_dflash
from eagle3.evaluate.served_eval import ServedReport, heldout_prompt_rows, served_acceptance, served_stats, with_images
from eagle3.evaluate.served_sweep import configured_sweep
from eagle3.draft.target_head import load_target_head, read_target_config
from eagle3.train.dflash_trainer import is_dflash_checkpoint, load_dflash_checkpoint, train_dflash
from eagle3.train.trainer import ADDED_WITH_DEFAULT, EVALS, LOSSES, RUNTIME_ONLY, TrainConfig, train_draft
from eagle3.draft.vocab import VocabConfig, build_mapping, count_tokens, save_mapping
from eagle3.online.feed import GIB, OnlineConfig, OnlineData, OnlineDataError, OnlineSample, check_buffer, plan_text
from eagle3.online.remote import clear_buffer
from eagle3.data.target import TargetConfig
from eagle3.engine import pool as engine_pool
from eagle3.engine.client import EngineGone
from eagle3.engine.placement import pin_process, split_cpus, trainer_on
from eagle3.gpu.devices import trainer_on_gpu
from eagle3.stages import _done, online_target_config, stage_fingerprint, states_fingerprint, target_engine

VOCAB_FILE = "vocab.safetensors"
TrainProgress = Callable[..., None]  # (step, steps, loss), and online: tokens captured so far
CAPTURE_ATTEMPTS = 3  # an engine that died mid-epoch is loaded afresh (twice at most), and the capture asked again
log = logging.getLogger(__name__)


# -- vocab -------------------------------------------------------------------------------
def fingerprint_vocab(config: VocabConfig, prepared: StageRecord) -> str:
    return stage_fingerprint("vocab", config, prepared.fingerprint)


def run_vocab(config: VocabConfig, prepared: StageRecord, target: StageRecord, root: Path, fp: str) -> StageRecord:
    final, done = _done(root, "vocab", fp)
    if done:
        return done
    info = TargetInfo.read(target.path)
    samples = conversations.read_samples(prepared.path / "train.jsonl")
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
    """Settings that change what is trained, as written: an 'auto' (train.dtype, train.deterministic,
    train.tokens_per_step) resolves on the machine that trains, but the fingerprint names the setting, so every
    machine names the same artifact (a sweep's parent without a GPU computes its points' fingerprints before a GPU
    worker trains them; a run resumes on another number of GPUs)."""
    settings = config.model_dump(exclude=RUNTIME_ONLY)
    settings["draft"] = resolve(config.draft, _target_text_config(target)).fingerprint_view()  # auto: what it trains
    for name, default in ADDED_WITH_DEFAULT.items():  # a setting added later, at its default: the old fingerprint
        if settings[name] == default:
            del settings[name]
    return stage_fingerprint("train", settings, states_fingerprint(extracted), vocab.fingerprint, target.fingerprint)


def _target_text_config(target: StageRecord) -> dict | None:
    """What train.draft's auto reads of the target (its model_type and kv_lora_rank): from the record's stats, which
    travel with it to every machine that names the train artifact; a record from before those stats, from its
    target_info.json and the target's config.json here; None for a record without its artifact (tests)."""
    if "kv_lora_rank" in target.stats:
        rank = int(target.stats["kv_lora_rank"])
        return {"model_type": str(target.stats.get("model_type", "")), "kv_lora_rank": rank or None}
    if not (target.path / INFO_FILE).is_file():
        return None
    model_dir = Path(TargetInfo.read(target.path).model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir / 'config.json'} is gone: the train stage reads the target's config to "
                                "resolve train.draft.architecture (and trains from that folder); restore the target "
                                "folder that stage_target read, or point target.model at the target again")
    return read_text_config(model_dir)


def run_train(config: TrainConfig, target: StageRecord, extracted: StageRecord, vocab: StageRecord, root: Path, fp: str,
              progress: TrainProgress | None = None, init_from: Path | None = None,
              online: OnlineSetup | None = None, say: Callable[[str], None] = print) -> StageRecord:
    """Trains in place (checkpoints under the artifact folder), so a killed run resumes.

    `init_from`: an exported draft to start from (the nightly warm start); the caller puts its
    identity into `fp`.
    `online`: train.data online/hybrid: the target engine captures what the extract record did not store
    (online_data); the stage tells `say` the plan first.

    Every checkpoint is scored by simulated acceptance on the held-out store; the record's
    `checkpoint` is the best one (the export takes it), `last_checkpoint` the last.
    """
    final, done = _done(root, "train", fp)
    if done:
        return done
    info = TargetInfo.read(target.path)
    heldout = extracted.path / "heldout"
    paths = {"store_dir": extracted.path / "train", "target_dir": Path(info.model_dir), "head_path": target.path / HEAD_FILE,
             "vocab_path": vocab.path / VOCAB_FILE, "heldout_store_dir": heldout if len(StoreReader(heldout)) else None,
             "init_from": init_from}
    processes = resolve_num_processes(config)  # per machine; train.nnodes machines (this one is node 0)
    if config.data != "store" and online is None:
        raise ValueError(f"train.data={config.data!r} needs the online settings and the target engine; the flow "
                         "passes them (run_train(online=OnlineSetup(...)))")
    if config.draft.method == "dflash":
        dflash_paths = {k: paths[k] for k in ("store_dir", "target_dir", "head_path", "heldout_store_dir", "init_from")}
        with (online_data(config, online, target, extracted, root, fp, say) if config.data != "store"
              else contextlib.nullcontext()) as data, trainer_on_gpu(config.devices):
            result = train_dflash(config, out_dir=final, progress=progress, online=data, **dflash_paths)
    elif config.data != "store":
        with online_data(config, online, target, extracted, root, fp, say) as data, trainer_on_gpu(config.devices):
            result = train_draft(config, out_dir=final, progress=progress, online=data, **paths)  # + tokens captured
    elif processes > 1 or config.nnodes > 1:
        result = train_distributed(config, processes, out_dir=final, progress=progress, **paths)
    else:
        with trainer_on_gpu(config.devices):  # train.devices: its first GPU
            result = train_draft(config, out_dir=final, progress=progress, **paths)
    if result.checkpoint is None or result.best_checkpoint is None:
        raise RuntimeError(f"training in {final} ended without a checkpoint")
    best = next((e for e in result.evals if e["checkpoint"] == result.best_checkpoint.name), None)
    stats = {
        "steps": result.steps_done, "final_loss": round(result.losses[-1], 5) if result.losses else float("nan"),
        "tokens_seen": result.tokens_seen, "seconds": round(result.seconds, 2),
        "resumed_from_step": -1 if result.resumed_from_step is None else result.resumed_from_step,
        "checkpoint": str(Path(result.best_checkpoint).relative_to(final)),
        "last_checkpoint": str(Path(result.checkpoint).relative_to(final)),
        "checkpoints_evaluated": len(result.evals),
        "best_acceptance_length": round(best["acceptance_length"], 4) if best else -1.0,
        "chosen_walk": round(best["walk"], 4) if best and "walk" in best else -1.0,
        "select": config.select,
        "init_from": str(init_from) if init_from is not None else "",
        "processes": processes,
        "nnodes": config.nnodes,
        "data": config.data,
    } | result.online | ({"method": "dflash"} if config.draft.method == "dflash" else {})
    return mark_complete(final, StageRecord(stage="train", uri=str(final), fingerprint=fp, stats=stats))


@dataclass(frozen=True)
class OnlineSetup:
    """What the train stage needs for train.data online/hybrid besides its own settings."""

    online: OnlineConfig
    target_config: TargetConfig
    load_log: Path  # <run_dir>/logs/target_loads.jsonl: the engine's load or attach is a line of it


@contextlib.contextmanager
def online_data(config: TrainConfig, setup: OnlineSetup, target: StageRecord, extracted: StageRecord, root: Path,
                fp: str, say: Callable[[str], None] = print) -> Iterator[OnlineData]:
    """The train split's samples, the kept store and a capture through the target's warm engine (eagle3.engine):
    the one the extract stage of this run attached to, or attached/started now. Tells `say` the plan first."""
    info = TargetInfo.read(target.path)
    if "train_kept" not in extracted.stats:
        raise ValueError(f"train.data={config.data!r}, but the extract artifact {extracted.path} stored the whole train "
                         "split (train.data='store'); the flow sets extract.store_budget_gib for online/hybrid runs")
    dtype = StoreReader(extracted.path / "heldout", verify=False).dtype
    storage = getattr(torch, dtype)
    check_buffer(setup.online.buffer_gib, config.batch_tokens, len(info.aux_layer_ids) + 1, info.hidden_size, storage)
    prepared = conversations.read_samples(Path(str(extracted.stats["train_samples_file"])))
    lengths = (json.loads(Path(str(extracted.stats["train_lengths_file"])).read_text())  # images expanded (extract)
               if "train_lengths_file" in extracted.stats else [None] * len(prepared))
    limit = setup.target_config.max_model_len - 1  # extract.too_long: refused by the extract stage, else truncated
    samples = [OnlineSample(s.input_ids[:limit], s.loss_mask[:limit], s.images, n if s.images else None)
               for s, n in zip(prepared, lengths, strict=True)]  # a sample with images is never truncated (extract)
    images = any(s.images for s in samples)
    if images and setup.online.producer == "remote":
        raise OnlineDataError("the train split holds images, and online.producer='remote' captures text only; set "
                              "online.producer='local' (the run's own engine loads the images), or train.data='store'")
    kept = int(extracted.stats["train_kept"])
    rate = extracted.stats.get("capture_tokens_per_s")
    budget = extracted.stats.get("store_budget_gib")
    say(f"train: {plan_text([s.tokens for s in samples], kept, config.batch_tokens, budget, rate)}")
    folder = Path(setup.online.buffer_dir) if setup.online.buffer_dir else root / "online_buffer" / fp
    remote = setup.online.producer == "remote"  # a capture worker elsewhere writes the shards (online_remote)
    cpus = None if torch.cuda.is_available() or remote else split_cpus(setup.online.engine_cpus)  # (engine's, trainer's)
    if cpus is not None:
        say(f"train: the engine on CPUs {sorted(cpus[0])}, the trainer on {sorted(cpus[1])} (online.engine_cpus="
            f"{setup.online.engine_cpus})")
    if remote:
        say(f"train: online.producer='remote': waiting for a capture worker on {folder}; on the machine with the target: "
            f"eagle3 online-capture --buffer {folder} --model {info.model_dir} --dtype {setup.target_config.dtype} "
            f"--max-model-len {setup.target_config.max_model_len} --kv-cache-gib {setup.target_config.kv_cache_gib:g}")
    capture = None if remote else _EngineCapture(setup, target, info.aux_layer_ids + [info.num_layers], info.hidden_size,
                                                 None if cpus is None else cpus[0],
                                                 images or "heldout_samples_file" in extracted.stats)  # extract's engine
    try:
        with trainer_on(None if cpus is None else cpus[1]):
            yield OnlineData(samples=samples, kept=kept, kept_store=extracted.path / "train" if kept else None,
                             capture=capture, buffer_dir=folder, buffer_bytes=int(setup.online.buffer_gib * GIB),
                             aux_layer_ids=list(info.aux_layer_ids), hidden_size=info.hidden_size,
                             storage_dtype=storage, producer=setup.online.producer,
                             remote_wait_s=setup.online.remote_wait_s,
                             capture_images=None if capture is None else capture.capture_images)
    finally:  # also when no feed opened (resumed at its last step): a killed run's shards and feed files go
        clear_buffer(folder)


class _EngineCapture:
    """eagle3.online.feed.Capture over the target's warm engine; an engine that dies (kill -9, a crash) is
    loaded afresh and asked again, CAPTURE_ATTEMPTS times in all, so a run outlives its engine."""

    def __init__(self, setup: OnlineSetup, target: StageRecord, layer_ids: list[int], hidden_size: int,
                 engine_cpus: frozenset[int] | None, images: bool = False) -> None:
        """`images`: the engine loads the vision tower (the extract stage's engine when its data held images)."""
        self.get_engine = target_engine(online_target_config(setup.target_config), target, setup.load_log, images)
        self.layer_ids, self.hidden_size, self.engine_cpus = layer_ids, hidden_size, engine_cpus
        self.pinned: set[int] = set()
        self.tokens = 0  # captured so far (the train stage's progress shows it beside the steps)

    def _engine(self) -> object:
        engine = self.get_engine()
        pid = getattr(engine, "pid", None)  # a warm engine process (an in-process engine is never pinned)
        if self.engine_cpus is not None and pid is not None and pid not in self.pinned:
            pin_process(pid, self.engine_cpus)  # online.engine_cpus: the engine's cores, apart from the trainer's
            self.pinned.add(pid)
        return engine

    def __call__(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        states = self._retry(lambda source: source.capture(prompts, self.layer_ids))  # per prompt [T, n_aux+1, H]
        self.tokens += sum(len(s) for s in states)
        return states

    def capture_images(self, prompts: Sequence[Sequence[int]],
                       images: Sequence[Sequence[str]]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """eagle3.online.feed.ImageCapture: the engine loads the images and expands their placeholders."""
        expanded, states = self._retry(lambda source: source.capture_images(prompts, images, self.layer_ids))
        self.tokens += sum(len(s) for s in states)
        return expanded, states

    def _retry(self, capture: Callable[[object], object]) -> object:  # noqa: ANN401 - the capture's own answer
        from eagle3.capture.source import open_source

        for attempt in range(1, CAPTURE_ATTEMPTS + 1):
            try:
                return capture(open_source("vllm", self._engine(), hidden_size=self.hidden_size, batch_tokens=1))
            except EngineGone as err:
                if attempt == CAPTURE_ATTEMPTS:
                    raise
                log.warning("online capture: %s; loading the target afresh (attempt %d of %d)", err, attempt + 1,
                            CAPTURE_ATTEMPTS)
                engine_pool.release_all(keep_warm=True)  # forget the dead one: the next acquire starts a new engine
        raise AssertionError("unreachable")


# -- export ------------------------------------------------------------------------------
def fingerprint_export(trained: StageRecord | str) -> str:
    """`trained`: the train record, or its fingerprint (a chain named before it runs, eagle3 sweep --on-workers)."""
    return stage_fingerprint("export", {}, trained if isinstance(trained, str) else trained.fingerprint)


def run_export(target: StageRecord, trained: StageRecord, vocab: StageRecord, root: Path, fp: str) -> StageRecord:
    final, done = _done(root, "export", fp)
    if done:
        return done
    info = TargetInfo.read(target.path)
    checkpoint = trained.path / str(trained.stats["checkpoint"])
    if is_dflash_checkpoint(checkpoint):  # train.draft.method: dflash (the target's vocabulary: no mapping)
        export_dflash(load_dflash_checkpoint(checkpoint), final)
    else:
        export_draft(checkpoint, final, target_dir=Path(info.model_dir), aux_layer_ids=info.aux_layer_ids,
                     vocab_path=vocab.path / VOCAB_FILE)
    stats = {"checkpoint": str(checkpoint), "train_dir": str(trained.path),
             "bytes": sum(p.stat().st_size for p in final.iterdir() if p.is_file())}
    return mark_complete(final, StageRecord(stage="export", uri=str(final), fingerprint=fp, stats=stats))


# -- evaluate ----------------------------------------------------------------------------
def fingerprint_evaluate(config: EvalConfig, exported: StageRecord | str, extracted: StageRecord) -> str:
    """`exported`: the export record, or its fingerprint. The served sweep's settings count only when set, so an
    evaluation without a sweep keeps the fingerprint it had before they existed."""
    unset = {name for name in ("served_concurrency", "served_k") if not getattr(config, name)}
    return stage_fingerprint("evaluate", config.model_dump(mode="json", exclude=unset),
                             exported if isinstance(exported, str) else exported.fingerprint, states_fingerprint(extracted))


def chain_fingerprints(train: TrainConfig, evaluate: EvalConfig, target: StageRecord, extracted: StageRecord,
                       vocab: StageRecord) -> dict[str, str]:
    """The fingerprints of one train -> export -> evaluate chain, named before any of it runs."""
    train_fp = fingerprint_train(train, extracted, vocab, target)
    export_fp = fingerprint_export(train_fp)
    return {"train": train_fp, "export": export_fp, "evaluate": fingerprint_evaluate(evaluate, export_fp, extracted)}


def run_evaluate(config: EvalConfig, target: StageRecord, exported: StageRecord, extracted: StageRecord,
                 root: Path, fp: str, progress: Progress | None = None,
                 serving: ServingSetup = ServingSetup()) -> StageRecord:
    """(a) simulated acceptance on the held-out states; (b) with `config.served`, vLLM serving the
    target with the draft on the held-out prompts (the held-out store's token ids, up to each
    assistant turn). Writes acceptance.json, acceptance.md and the PNG plots.

    `progress` (done, total, tokens): one item per held-out sample scored, then two per served
    prompt (with and without the draft), which count when the served evaluation returns. `serving`: how the served
    engines run (the target's tensor parallel size, vLLM's compile cache; not part of the fingerprint)."""
    final, done = _done(root, "evaluate", fp)
    if done:
        return done
    heldout = extracted.path / "heldout"
    reader = StoreReader(heldout)  # checks the shards' sha256 once for both evaluations
    if len(reader) == 0:
        raise ValueError("no held-out samples to evaluate on; raise data.heldout_fraction or data.max_samples")
    info = TargetInfo.read(target.path)
    target_config = read_target_config(Path(info.model_dir))
    head = load_target_head(target.path / HEAD_FILE, target_config)
    prompts: list[list[int]] = []
    sources: list[str | None] = []  # each prompt's data source
    images: list = []
    longest = 0
    if config.served:
        limit = target_config.max_position_embeddings - config.served_max_new_tokens - config.num_draft_tokens - 1
        pairs = ((s.input_ids.tolist(), s.loss_mask.tolist()) for s in reader)
        rows = heldout_prompt_rows(pairs, config.served_max_prompts, limit)
        by_index = reader.sample_sources()
        prompts, sources = [p for _, p in rows], [by_index[i] for i, _ in rows]
        longest = max((len(p) for p in prompts), default=0)  # as the engine runs them: images expanded
        prompts, images = _served_images(extracted, reader, rows, info.model_dir)
    bar = _EvalProgress(progress, len(reader) + 2 * len(prompts))
    if is_dflash(json.loads((exported.path / "config.json").read_text())):
        result = evaluate_dflash(config, exported.path, reader, head.embed, target_dir=Path(info.model_dir),
                                 prompts=prompts, sources=sources, images=images, longest=longest, serving=serving,
                                 on_simulated=bar.simulated, on_served=bar.served)
        with building(final) as tmp:
            payload = result.payload()
            if result.sweep is not None:
                payload["plots"] = [plot_served_sweep(payload["served_sweep"]["rows"], tmp / SWEEP_PNG).name]
            atomic_write_text(tmp / "acceptance.json", json.dumps(payload, indent=1))
            atomic_write_text(tmp / "acceptance.md", result.markdown(served_k_set=bool(config.served_k)))
            return mark_complete(tmp, StageRecord(stage="evaluate", uri=str(final), fingerprint=fp, stats=result.stats()))
    report = simulate_acceptance(exported.path, heldout, head, num_draft_tokens=config.num_draft_tokens, verify=False,
                                 progress=bar.simulated)
    served = None
    if config.served:
        served = served_acceptance(
            Path(info.model_dir), exported.path, prompts, num_draft_tokens=config.num_draft_tokens,
            max_new_tokens=config.served_max_new_tokens, dtype=config.served_dtype,
            kv_cache_gib=config.served_kv_cache_gib, near_tie_gap=config.near_tie_logprob_gap, sources=sources,
            images=images, longest_prompt=longest, setup=serving,
        )
        bar.served(served.generated_tokens)
    sweep = configured_sweep(config, Path(info.model_dir), exported.path, prompts, images, serving) if config.served else None
    with building(final) as tmp:
        plots = _plots(tmp, exported, report, served)
        payload = {"simulated": report.to_dict(), "served": served.to_dict() if served is not None else None, "plots": plots}
        if sweep is not None:
            payload["served_sweep"] = sweep.to_dict()
            payload["plots"] = [*plots, plot_served_sweep(payload["served_sweep"]["rows"], tmp / SWEEP_PNG).name]
        atomic_write_text(tmp / "acceptance.json", json.dumps(payload, indent=1))
        atomic_write_text(tmp / "acceptance.md", _markdown(report, served, plots, _checkpoint_table(exported),
                                                           _source_section(payload, served))
                          + ("\n" + sweep.to_markdown(plot=SWEEP_PNG) if sweep is not None else ""))
        stats = {"acceptance_length": round(report.acceptance_length, 4), "num_drafts": report.num_drafts,
                 "per_position": json.dumps([round(p, 4) for p in report.per_position])}
        stats |= served_stats(served)
        if report.by_source:  # what the nightly gate compares per source
            stats["per_source"] = json.dumps({f.source: {"acceptance_length": round(f.simulated, 4), "walk": round(f.walk, 4),
                                                         "num_drafts": f.drafts, "served_acceptance_length":
                                                         None if f.served is None else round(f.served, 4)}
                                              for f in SourceFigures.from_payload(payload)})
        return mark_complete(tmp, StageRecord(stage="evaluate", uri=str(final), fingerprint=fp, stats=stats))


def serving_setup(target: TargetConfig, cache_root: Path) -> ServingSetup:
    """How the served evaluation's engines run for this target: at target.tensor_parallel_size, with vLLM's compiled
    graphs kept under the cache root (`cache_dir`, else $EAGLE3_CACHE_DIR) so that later loads skip compiling."""
    return ServingSetup(tensor_parallel_size=target.tensor_parallel_size, cache_dir=str(cache_root / "vllm"))


def _served_images(extracted: StageRecord, reader: StoreReader, rows: list[tuple[int, list[int]]],
                   model_dir: str) -> tuple[list[list[int]], list[list[str]]]:
    """The served prompts and their image URLs (eagle3.evaluate.served_eval.with_images): from the prepared held-out
    samples extract names when they hold images (its stat `heldout_samples_file`); else the store's prompts, text only."""
    prompts = [p for _, p in rows]
    named = extracted.stats.get("heldout_samples_file")
    if not named:
        return prompts, [[] for _ in prompts]
    from eagle3.data.images import placeholder_id

    if not Path(str(named)).is_file():
        raise ValueError(f"eval.served: the extract record {extracted.uri} names its held-out samples with images "
                         f"{named}, which is gone; expected the prepare_data artifact it was extracted from (run again: it is "
                         "rebuilt at the same path), or set eval.served=false")
    prepared = {s.id: s for s in conversations.read_samples(Path(str(named)))}
    sample_ids = [sid for entry in reader.shards for sid in entry.sample_ids]
    return with_images(rows, sample_ids, prepared, placeholder_id(model_dir))


class _EvalProgress:
    """evaluate's one bar: the held-out samples scored, then two items per served prompt (the runs
    with and without the draft), counted when the served evaluation returns."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress, self.total, self.tokens = progress, total, 0
        self._tell(0, 0)

    def simulated(self, done: int, _total: int, tokens: int) -> None:
        self.tokens = tokens
        self._tell(done, tokens)

    def served(self, generated_tokens: int) -> None:
        self._tell(self.total, self.tokens + 2 * generated_tokens)  # both runs generate about as many tokens

    def _tell(self, done: int, tokens: int) -> None:
        if self.progress is not None:
            self.progress(done, self.total, tokens)


def _train_logs(exported: StageRecord) -> tuple[list[dict], list[dict], str]:
    """The exported draft's training: its losses.jsonl and evals.jsonl entries, and the checkpoint it was taken from."""
    train_dir = Path(str(exported.stats.get("train_dir", "")))
    if not str(train_dir) or not (train_dir / LOSSES).is_file():
        return [], [], ""
    entries = [json.loads(line) for line in (train_dir / LOSSES).read_text().splitlines() if line.strip()]
    evals = [json.loads(line) for line in (train_dir / EVALS).read_text().splitlines() if line.strip()] \
        if (train_dir / EVALS).is_file() else []
    return entries, evals, Path(str(exported.stats.get("checkpoint", ""))).name


def _plots(out: Path, exported: StageRecord, report: AcceptanceReport, served: ServedReport | None) -> list[str]:
    """PNG plots into `out`: acceptance by position, and the training loss when its log is found."""
    made = [plot_acceptance(report.per_position, served.per_position if served else None, out / ACCEPTANCE_PNG).name]
    entries, evals, chosen = _train_logs(exported)
    if entries:
        made.append(plot_training_loss(entries, evals, out / LOSS_PNG, chosen=chosen).name)
    return made


def _checkpoint_table(exported: StageRecord) -> str:
    """Each checkpoint's held-out figures, and which one the export took (train.select)."""
    _, evals, chosen = _train_logs(exported)
    if not evals:
        return ""
    lines = ["## (c) Checkpoints\n", "Every checkpoint scored on the held-out split; the export took the one marked "
             "(train.select: 'best' takes the highest walk, 'last' the last).\n",
             "| checkpoint | step | simulated | walk | exported |", "|---|---:|---:|---:|---|"]
    for e in evals:
        walk = f"{e['walk']:.3f}" if "walk" in e else ""
        lines.append(f"| {e['checkpoint']} | {e['step']} | {e['acceptance_length']:.3f} | {walk} | "
                     f"{'**yes**' if e['checkpoint'] == chosen else ''} |")
    return "\n".join(lines) + "\n"


def _source_section(payload: dict, served: ServedReport | None) -> str:
    """acceptance.md's figures per data source ('' when the held-out samples name none)."""
    rows = SourceFigures.from_payload(payload)
    if not rows:
        return ""
    if served is None:
        note = "Served by vLLM: not run (evaluate.served is off)."
    elif not served.per_source:
        note = "Served by vLLM: this vLLM gave no per-request counters, so no served figure per source."
    else:
        note = "Served by vLLM: each source's requests pooled, 1 + accepted / drafts, as vLLM pools all of them."
    return ("## Per data source\n\nThe figures above for each data source's held-out samples (simulated, and the "
            "served-positions walk: the drafts a served run would make). " + note + "\n\n" + SourceFigures.markdown(rows))


def _markdown(report: AcceptanceReport, served: ServedReport | None, plots: list[str], checkpoints: str = "",
              sources: str = "") -> str:
    parts = ["# Acceptance\n", "## (a) Simulated on held-out hidden states\n", report.to_markdown()]
    parts += ["## (b) Served by vLLM (speculative decoding)\n",
              served.to_markdown() if served is not None else "Not run (evaluate.served is off).\n"]
    parts += [sources] if sources else []
    parts += [checkpoints] if checkpoints else []
    parts += [f"![{name.removesuffix('.png').replace('_', ' ')}]({name})\n" for name in plots]
    return "\n".join(parts)
