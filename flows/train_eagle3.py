"""The train_eagle3 flow: the whole DAG, read top to bottom.

gpu_cleanup -> stage_target -> (synthesize) -> regenerate -> prepare_data -> extract -> gpu_cleanup
-> vocab -> train -> export -> evaluate

Each cached stage is keyed by its content fingerprint; the flow computes it from the
upstream records, checks that the artifact is whole, and calls the task. The target is
loaded by the first stage that has real work for it (synthesize, regenerate or extract) and
shared by them; it is released before training. synthesize runs only with data.source
synthesize (docs/synthesize.md): the target writes the prompts that regenerate then answers.

train.data online/hybrid (docs/online-training.md): the target runs in a warm engine process
(eagle3.engine) that stays loaded from extract through train and captures the train split's
states as the trainer goes; extract stores only the held-out split and, for hybrid, the train
samples that fit extract.store_budget_gib. The engine is stopped right after train, and one `gpu`
slot ("online") is held from the first gpu_cleanup to evaluate (the engine spans both blocks).

Two blocks hold the `gpu` concurrency slot (tasks.gpu_slot.gpu_slot), so that two runs never
share the GPUs: from the first gpu_cleanup until the target is released and the GPUs are
verified clean, and from train to evaluate.

Retrying a failed run (`prefect flow-run retry`, Retry in the UI) re-runs it under the same
id: every stage that finished comes back Cached, the failed one and those after it run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from eagle3 import draft_stages, stages
from eagle3.artifacts import StageRecord
from eagle3.capture import vllm_adapter
from eagle3.config import PipelineConfig, check_against_target
from eagle3.data.builtin_targets import default_cache_dir
from eagle3.data.conversations import SYNTHESIZE
from eagle3.data.target import TargetInfo
from eagle3.engine import pool as engine_pool
from eagle3.ops import incremental, parts
from eagle3.ops.summary import RunSummary, data_report, loads_since, write_summary
from flows.report import run_report
from flows.runner import StageFailed, StageRunner, enter_work_dir, open_runner
from tasks import draft as draft_tasks
from tasks import nightly as nightly_tasks
from tasks import parts as part_tasks
from tasks import stages as data_tasks
from tasks.gpu import gpu_cleanup
from tasks.gpu_slot import gpu_slot

__all__ = ["Chain", "StageFailed", "draft_chain", "target_stages", "train_eagle3"]


@dataclass
class Chain:
    """The records of one train -> export -> evaluate chain, filled in as its stages finish."""

    trained: StageRecord | None = None
    exported: StageRecord | None = None
    evaluated: StageRecord | None = None

    def outcome(self) -> dict[str, object]:
        """RunSummary's export_dir, acceptance_length and evaluation, for the stages that finished."""
        out: dict[str, object] = {}
        if self.exported is not None:
            out["export_dir"] = self.exported.uri
        if self.evaluated is not None:
            out["acceptance_length"] = self.evaluated.stats["acceptance_length"]
            out["evaluation"] = self.evaluated.uri
        return out


def target_stages(run: StageRunner, config: PipelineConfig, load_log: Path, cleanups: list[dict],
                  outcome: dict[str, object], also_check: Sequence[PipelineConfig] = ()) -> tuple[StageRecord, StageRecord, StageRecord]:
    """gpu_cleanup -> stage_target -> regenerate -> prepare_data -> extract -> gpu_cleanup, holding the
    `gpu` slot; returns the target, prepared and extracted records (outcome gets `data`). `config` and
    each of `also_check` (a sweep's points) are checked against the target right after stage_target."""
    run_dir = Path(config.run_dir)
    engine_pool.check_sleep_during_train(config.target.sleep_during_train)
    online = config.train.data != "store"  # the engine stays loaded into training: the caller holds the slot
    target_config = stages.online_target_config(config.target) if online else config.target
    extract_config = stages.online_extract_config(config.train.data, config.extract)
    with contextlib.nullcontext() if online else gpu_slot(run_dir, "target"):
        cleanups.append(run.uncached("gpu_cleanup", gpu_cleanup, config=config.gpu, run_dir=run_dir))
        target = run.stage("stage_target", data_tasks.stage_target, stages.fingerprint_target(config.target),
                           config=config.target, cache_dir=config.builtin_cache)
        for checked in (config, *also_check):
            check_against_target(checked, TargetInfo.read(target.path))  # in seconds, not after extraction
        data, synthesized = config.data, None
        if data.source == SYNTHESIZE:  # the target writes the prompts; regenerate answers them (one engine load)
            synthesized = run.stage("synthesize", data_tasks.synthesize,
                                    stages.fingerprint_synthesize(config.synthesize, config.regenerate, target),
                                    config=config.synthesize, regen=config.regenerate, target_config=target_config,
                                    target=target, load_log=load_log)
            data = stages.synthesized_data(data, synthesized, config.synthesize.prompts)
        regen = run.stage("regenerate", data_tasks.regenerate,
                          stages.fingerprint_regenerate(config.regenerate, data, target, config.target.max_model_len),
                          config=config.regenerate, data_config=data, target_config=target_config, target=target,
                          load_log=load_log)
        prepared = run.stage("prepare_data", data_tasks.prepare_data, stages.fingerprint_prepare(data, regen, target),
                             config=data, regenerated=regen, target=target, trust_remote_code=config.target.trust_remote_code)
        outcome["data"] = data_report(regen, prepared, synthesized)
        extracted = run.stage("extract", data_tasks.extract, stages.fingerprint_extract(extract_config, config.target, prepared, target),
                              config=extract_config, target_config=target_config, prepared=prepared, target=target, load_log=load_log)
        if not online:  # free the target's memory before training: our warm engine stops, or sleeps (target.sleep_during_train)
            engine_pool.release_all(keep_warm=False, sleep=config.target.sleep_during_train)
            engine_pool.make_room(default_cache_dir(), "", load_log)  # and other runs' idle engines on the GPUs: training needs them
            cleanups.append(run.uncached("gpu_cleanup", gpu_cleanup, config=config.gpu, run_dir=run_dir))
        elif config.online.producer == "remote":  # a capture worker with its own engine captures for the trainer
            engine_pool.release_all(keep_warm=False)
    return target, prepared, extracted


def fanned_out_stages(run: StageRunner, config: PipelineConfig, outcome: dict[str, object]) -> tuple[StageRecord, StageRecord]:
    """`extract.parts` > 1: stage_target -> split_data -> part i (a flow run each on the gpu pool, side by
    side) -> assemble; returns the target and the assembled record (prepared data and store in one).
    This run loads no target, so it takes no `gpu` slot here: each part takes its worker's."""
    target = run.stage("stage_target", data_tasks.stage_target, stages.fingerprint_target(config.target),
                       config=config.target, cache_dir=config.builtin_cache)
    check_against_target(config, TargetInfo.read(target.path))
    count = config.extract.parts
    part_tasks.check_part_deployment(config.extract.part_deployment)
    split = run.stage("split_data", part_tasks.split_data, parts.fingerprint_split(config.data, count),
                      config=config.data, parts_count=count)
    calls = []
    for index in range(count):
        fp = parts.fingerprint_part(config, split.fingerprint, index, target.fingerprint)
        parameters = {"config": parts.part_config(config, split.fingerprint, index), "split_fp": split.fingerprint,
                      "index": index, "part_fp": fp}
        calls.append((fp, f"part {index}", {"deployment": config.extract.part_deployment, "parameters": parameters,
                                             "timeout_s": config.extract.part_timeout_s, "artifact_url": config.artifact_url}))
    pieces = []
    for done in run.concurrent("part", part_tasks.run_part, calls):
        prepared, extracted = parts.read_part(done)
        pieces.append((None, run.localized("prepare_data", prepared), run.localized("extract", extracted)))
    assembled = run.stage("assemble", nightly_tasks.assemble, incremental.fingerprint_assemble(pieces), parts=pieces)
    outcome["data"] = {"parts": count, "train_samples": assembled.stats["train_samples"],
                       "heldout_samples": assembled.stats["heldout_samples"]}
    return target, assembled


def draft_chain(run: StageRunner, config: PipelineConfig, target: StageRecord, extracted: StageRecord,
                vocab: StageRecord, chain: Chain, tag: str = "", online: draft_stages.OnlineSetup | None = None) -> Chain:
    """train -> export -> evaluate, holding the `gpu` slot; `chain` is filled as each stage finishes
    (so a failure still leaves what was done). `tag` is appended to the printed stage names.
    `online` (train.data online/hybrid): the caller holds the slot, the target's engine captures during train
    and is stopped right after it."""
    fps = draft_stages.chain_fingerprints(config.train, config.eval, target, extracted, vocab)
    with contextlib.nullcontext() if online else gpu_slot(Path(config.run_dir), "draft"):
        chain.trained = run.stage("train", draft_tasks.train, fps["train"], label=f"train{tag}", config=config.train,
                                  target=target, extracted=extracted, vocab=vocab, online=online)
        if online is not None:
            engine_pool.release_all(keep_warm=False)  # training is over: the engine this run started stops
        chain.exported = run.stage("export", draft_tasks.export, fps["export"], label=f"export{tag}", target=target,
                                   trained=chain.trained, vocab=vocab)
        chain.evaluated = run.stage("evaluate", draft_tasks.evaluate, fps["evaluate"], label=f"evaluate{tag}",
                                    config=config.eval, target=target, exported=chain.exported, extracted=extracted,
                                    serving=draft_stages.serving_setup(config.target, config.builtin_cache))
        vllm_adapter.release_all()
    return chain


@flow(name="train-eagle3", log_prints=False)
def train_eagle3(config: PipelineConfig) -> RunSummary:
    enter_work_dir()  # a worker's run (the UI's, a sweep's point): its relative run_dir under $EAGLE3_WORK_DIR
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    load_log = run_dir / "logs" / "target_loads.jsonl"
    run = open_runner(config.artifact_url, config.artifacts, run_dir)
    outcome: dict[str, object] = {}
    cleanups: list[dict] = []
    started = time.time()
    chain = Chain()
    try:
        if config.train.data != "store":  # one slot from the first gpu_cleanup to evaluate: the engine spans both
            with gpu_slot(run_dir, "online"):
                target, prepared, extracted = target_stages(run, config, load_log, cleanups, outcome)
                vocab = run.stage("vocab", draft_tasks.vocab, draft_stages.fingerprint_vocab(config.vocab, prepared),
                                  config=config.vocab, prepared=prepared, target=target)
                setup = draft_stages.OnlineSetup(config.online, stages.online_target_config(config.target), load_log)
                draft_chain(run, config, target, extracted, vocab, chain, online=setup)
        else:
            if config.extract.parts > 1:
                target, extracted = fanned_out_stages(run, config, outcome)
                prepared = extracted  # the assembled artifact holds both (eagle3.ops.incremental)
            else:
                target, prepared, extracted = target_stages(run, config, load_log, cleanups, outcome)
            vocab = run.stage("vocab", draft_tasks.vocab, draft_stages.fingerprint_vocab(config.vocab, prepared),
                              config=config.vocab, prepared=prepared, target=target)
            draft_chain(run, config, target, extracted, vocab, chain)
    finally:
        engine_pool.release_all(keep_warm=True)  # a failed run leaves its warm engine up for target.keep_warm_s
        summary = RunSummary(stages=list(run.rows), gpu_cleanup=cleanups, target_loads=loads_since(load_log, started),
                             **outcome, **chain.outcome())
        write_summary(run_dir / "summary.json", summary)
        report = run_report(summary, run_dir, title="train-eagle3",
                            sources=[chain.trained.path if chain.trained else None])
        create_markdown_artifact(key="eagle3-run-summary", markdown=report, description="stages, acceptance, plots")
    return summary
