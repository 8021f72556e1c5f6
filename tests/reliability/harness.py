"""Kill anywhere: SIGKILL `eagle3 run` at a chosen moment, run it again until it completes, check what survived.

Shared by tests/reliability/test_kill_anywhere.py (a few moments, in `make test`) and
benchmarks/chaos.py (the full matrix). A moment is an event the harness can observe from
outside the process (a stage's printed line, a shard or checkpoint file appearing) plus a
seeded delay; the whole process group is killed then. What a user would check afterwards:

- the rerun completes, and every stage that had finished before the kill comes back Cached;
- the exported draft holds the same tensors as an uninterrupted run's;
- no temporary file (`.X.tmp-*`, `.X.building-*`, `.X.old-*`) is left anywhere in the run dir;
- the hidden-state store holds every prepared sample exactly once, its manifests agree with
  the shard files (size and sha256) and lists every shard on disk; every artifact's completion
  marker agrees with its files; every checkpoint loads and verifies.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from eagle3.artifacts import read_complete
from eagle3.capture.store import MANIFEST, StoreReader
from eagle3.data.conversations import read_samples
from eagle3.draft.checkpoint import latest_valid_checkpoint, list_checkpoints, load_checkpoint

ROOT = Path(__file__).resolve().parents[2]
# Printed stage lines in flow order (gpu_cleanup runs twice); "startup" = before the first line.
ORDER = ["startup", "gpu_cleanup", "stage_target", "regenerate", "prepare_data", "extract", "gpu_cleanup#2",
         "vocab", "train", "export", "evaluate", "summary"]
TEMPORARY = re.compile(r"^\..*\.(tmp|building|old)(-|$)|\.tmp$")
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
Trigger = Callable[[Path, list[str]], bool]  # (run dir, stages printed so far) -> the moment has come


@dataclass(frozen=True)
class Moment:
    """Kill `delay` seconds after `trigger` first holds. `aim` is the stage it means to hit."""

    name: str
    aim: str
    trigger: Trigger
    delay: float = 0.0
    fresh_cache: bool = False  # an empty EAGLE3_CACHE_DIR: stage_target builds the tiny target (seconds, not ms)


def after_line(stage: str) -> Trigger:
    return lambda run_dir, printed: stage in printed


def after_start() -> Trigger:
    return lambda run_dir, printed: True


def when_file(pattern: str, count: int = 1) -> Trigger:
    """When at least `count` paths match `pattern` (a glob under the run dir)."""
    return lambda run_dir, printed: len(list(run_dir.glob(pattern))) >= count


def any_of(*triggers: Trigger) -> Trigger:
    """When any of `triggers` holds."""
    return lambda run_dir, printed: any(trigger(run_dir, printed) for trigger in triggers)


def all_of(*triggers: Trigger) -> Trigger:
    """When every one of `triggers` holds."""
    return lambda run_dir, printed: all(trigger(run_dir, printed) for trigger in triggers)


def building_target() -> Trigger:
    """When the builtin target's temporary build folder appears in the run's own (fresh) target cache."""
    return lambda run_dir, printed: any(run_dir.parent.glob(f"{run_dir.name}-cache/.tiny-llama-*.tmp-*"))


def moments(seed: int, count: int) -> list[Moment]:
    """`count` moments spread over every stage (round robin over the stages, seeded delays and file counts)."""
    rng = random.Random(seed)
    shard = "artifacts/extract/*/train/shard-*.safetensors"
    ckpt = "artifacts/train/*/checkpoints/step-*"
    makers = [
        lambda: Moment("while starting (imports, flow run)", "startup", after_start(), rng.uniform(0.5, 3.0)),
        lambda: Moment("stage_target: building the target into an empty cache", "stage_target", building_target(),
                       rng.uniform(0.0, 0.3), fresh_cache=True),
        lambda: Moment("regenerate: engine load or generation", "regenerate", after_line("stage_target"), rng.uniform(0.5, 12.0)),
        lambda: Moment("right after regenerate", "prepare_data", after_line("regenerate"), rng.uniform(0.0, 0.08)),
        lambda: (n := rng.randint(1, 4), Moment(f"extract: once {n} train shard(s) exist", "extract", when_file(shard, n)))[1],
        lambda: Moment("between extract and train (gpu_cleanup, vocab)", "vocab", after_line("extract"), rng.uniform(0.0, 2.0)),
        lambda: Moment("train: while a checkpoint is being written", "train", when_file("artifacts/train/*/checkpoints/.step-*.tmp-*")),
        lambda: (n := rng.randint(1, 2), Moment(f"train: once {n} checkpoint(s) exist", "train", when_file(ckpt, n),
                                                rng.uniform(0.0, 0.3)))[1],
        lambda: Moment("export", "export", after_line("train"), rng.uniform(0.0, 0.4)),
        lambda: Moment("evaluate", "evaluate", after_line("export"), rng.uniform(0.0, 0.5)),
        lambda: Moment("summary and report, after the last stage", "summary", after_line("evaluate"), rng.uniform(0.0, 0.3)),
    ]
    return [makers[i % len(makers)]() for i in range(count)]


@dataclass
class Attempt:
    returncode: int
    printed: list[str]  # stage lines in order: "<stage> <state>"
    output: str


@dataclass
class Outcome:
    moment: Moment
    hit: str  # the stage that was running when the kill landed ("summary" = after the last stage)
    attempts: int = 0  # runs after the kill until one completed
    redone: list[str] = field(default_factory=list)  # stages finished before the kill but computed again
    problems: list[str] = field(default_factory=list)  # what the checks found (empty: nothing lost)
    checkpoint: int | None = None  # the step of the newest valid training checkpoint on disk after the kill
    loads: int = 0  # lines in the run's logs/target_loads.jsonl after the kill (each a target loaded or attached)


def cli_env(api_url: str, cache_dir: Path) -> dict[str, str]:
    return os.environ | ENV | {"PREFECT_API_URL": api_url, "EAGLE3_CACHE_DIR": str(cache_dir)}


def cli_env_without_server(prefect_home: Path, cache_dir: Path) -> dict[str, str]:
    """The README's first way to run: no PREFECT_API_URL, so each run starts its own temporary server."""
    env = os.environ | ENV | {"PREFECT_HOME": str(prefect_home), "EAGLE3_CACHE_DIR": str(cache_dir)}
    env.pop("PREFECT_API_URL", None)
    return env


def _stage_lines(output: str) -> list[str]:
    names = set(ORDER) | {"gpu_cleanup"}
    out = []
    for line in output.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in names and parts[1] in ("Completed", "Cached", "Failed"):
            out.append(f"{parts[0]} {parts[1]}")
    return out


def _labels(printed: list[str]) -> list[str]:
    """Printed lines -> ORDER labels (the second gpu_cleanup is gpu_cleanup#2)."""
    out = []
    for line in printed:
        name = line.split()[0]
        out.append("gpu_cleanup#2" if name == "gpu_cleanup" and "gpu_cleanup" in out else name)
    return out


def run_args(run_dir: Path, overrides: list[str]) -> list[str]:
    return ["run", "--preset", "tiny", "--run-dir", str(run_dir), *[a for o in overrides for a in ("--set", o)]]


def run_once(args: list[str], env: dict[str, str], kill: Moment | None = None, timeout: float = 900) -> Attempt:
    """One `eagle3 run` in its own process group; with `kill`, SIGKILL the group at that moment."""
    run_dir = Path(args[args.index("--run-dir") + 1])
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.time() + timeout
    fired_at = None
    try:
        while proc.poll() is None and time.time() < deadline:
            if kill is not None:
                labels = _labels(_stage_lines("".join(chunks)))
                if fired_at is None and kill.trigger(run_dir, labels):
                    fired_at = time.time() + kill.delay
                if fired_at is not None and time.time() >= fired_at:
                    os.killpg(proc.pid, signal.SIGKILL)  # the whole tree: the CLI, vLLM, any child
                    break
            time.sleep(0.01)
    finally:
        if proc.poll() is None and (kill is None or time.time() >= deadline):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(timeout=30)
    output = "".join(chunks)
    return Attempt(proc.returncode, _stage_lines(output), output)


def hit_stage(killed: Attempt) -> str:
    """The stage running when the process died: the one after the last printed line."""
    if "eagle3: run dir" not in killed.output:  # printed just before the flow starts
        return "startup"
    labels = _labels(killed.printed)
    done = len(labels)
    return ORDER[done + 1] if done + 1 < len(ORDER) else "summary"


def run_until_complete(args: list[str], env: dict[str, str], max_attempts: int = 3) -> tuple[int, Attempt]:
    for attempt in range(1, max_attempts + 1):
        result = run_once(args, env)
        if result.returncode == 0:
            return attempt, result
    return max_attempts, result


@dataclass(frozen=True)
class Reference:
    """What an uninterrupted run produced: the export's tensors and each store shard's sha256."""

    export: dict[str, torch.Tensor]
    shards: dict[str, str]  # "<split>/<shard file>" of the run's extract store -> sha256


def reference_of(run_dir: Path) -> Reference:
    summary = json.loads((run_dir / "summary.json").read_text())
    return Reference(load_file(str(Path(summary["export_dir"]) / "model.safetensors")), shard_hashes(run_dir))


def shard_hashes(run_dir: Path) -> dict[str, str]:
    out = {}
    for manifest in (run_dir / "artifacts").glob(f"extract/*/*/{MANIFEST}"):
        for entry in json.loads(manifest.read_text())["shards"]:
            if entry is not None:
                key = f"{manifest.parent.name}/{entry['file']}"
                out[key] = entry["sha256"] if key not in out else "two extract stores in one run dir"
    return out


def temporaries(folder: Path) -> list[str]:
    return [str(p.relative_to(folder)) for p in folder.rglob(".*") if TEMPORARY.search(p.name)]


def check_run_dir(run_dir: Path, reference: Reference) -> list[str]:
    """Everything a user would find wrong in a completed run dir (empty list: nothing)."""
    problems: list[str] = []
    got = reference_of(run_dir)
    if got.shards != reference.shards:
        differ = sorted(k for k in reference.shards.keys() | got.shards.keys() if got.shards.get(k) != reference.shards.get(k))
        problems.append(f"store shards differ from the uninterrupted run's (sha256): {differ}")
    got, reference = got.export, reference.export
    if got.keys() != reference.keys():
        problems.append(f"export tensors {sorted(got)} != {sorted(reference)}")
    differ = [k for k in reference if k in got and not torch.equal(got[k], reference[k])]
    if differ:
        worst = max(float((got[k].float() - reference[k].float()).abs().max()) for k in differ)
        problems.append(f"export tensors differ from the uninterrupted run: {differ} (max abs diff {worst:.3g})")
    if left := temporaries(run_dir):
        problems.append(f"temporary files left: {left}")
    artifacts = run_dir / "artifacts"
    for folder in sorted(p for p in artifacts.glob("*/*") if p.is_dir() and p.parent.name != "prefect-results"):
        if read_complete(folder) is None:
            problems.append(f"{folder.relative_to(run_dir)}: completion marker missing or disagrees with its files")
    problems += check_stores(artifacts)
    for ckpt in (c for folder in artifacts.glob("train/*/checkpoints") for c in list_checkpoints(folder)):
        try:
            load_checkpoint(ckpt)
        except Exception as err:  # noqa: BLE001 - reported, not raised
            problems.append(f"checkpoint {ckpt.relative_to(run_dir)}: {err}")
    return problems


def check_stores(artifacts: Path) -> list[str]:
    """Each extract store against its prepared data: every sample once, manifest == files."""
    problems = []
    prepared = {p.name: p for p in artifacts.glob("prepare_data/*") if read_complete(p) is not None}
    for extract in artifacts.glob("extract/*"):
        for split in ("train", "heldout"):
            store = extract / split
            try:
                reader = StoreReader(store)
                reader.verify()
            except Exception as err:  # noqa: BLE001
                problems.append(f"{store}: {err}")
                continue
            ids = [i for entry in reader.shards for i in entry.sample_ids]
            if len(ids) != len(set(ids)):
                problems.append(f"{store}: duplicate samples {sorted({i for i in ids if ids.count(i) > 1})}")
            on_disk = {p.name for p in store.glob("shard-*.safetensors")}
            listed = {entry.file for entry in reader.shards}
            if on_disk != listed:
                problems.append(f"{store}: shard files {sorted(on_disk ^ listed)} not matched by {MANIFEST}")
            wanted = [{s.id for s in read_samples(p / f"{split}.jsonl")} for p in prepared.values()]
            if set(ids) not in wanted:
                problems.append(f"{store}: holds {len(set(ids))} samples that match no prepared {split} set")
    return problems


def kill_and_recover(moment: Moment, run_dir: Path, overrides: list[str], env: dict[str, str],
                     reference: Reference, after_kill: Callable[[Path], None] | None = None) -> Outcome:
    """Run, kill at `moment`, (`after_kill(run_dir)`: more damage), rerun until complete, check.

    The kill must land (else the outcome says so)."""
    args = run_args(run_dir, overrides)
    if moment.fresh_cache:
        env = env | {"EAGLE3_CACHE_DIR": str(run_dir.parent / f"{run_dir.name}-cache")}
    killed = run_once(args, env, kill=moment)
    if killed.returncode != -signal.SIGKILL:
        return Outcome(moment, "none", problems=[f"the run ended ({killed.returncode}) before the kill: {killed.output[-2000:]}"])
    if after_kill is not None:
        after_kill(run_dir)
    outcome = Outcome(moment, hit_stage(killed))
    finished = {label for label, line in zip(_labels(killed.printed), killed.printed) if not line.endswith("Failed")}
    outcome.attempts, final = run_until_complete(args, env)
    if final.returncode != 0:
        outcome.problems.append(f"no rerun completed in {outcome.attempts} attempts: {final.output[-3000:]}")
        return outcome
    outcome.redone = _redone(finished, final.printed)
    outcome.problems += [f"finished stage {s} was computed again" for s in outcome.redone]
    outcome.problems += check_run_dir(run_dir, reference)
    if moment.fresh_cache:
        if left := temporaries(Path(env["EAGLE3_CACHE_DIR"])):
            outcome.problems.append(f"temporary files left in the target cache: {left}")
    return outcome


def truncate_newest_checkpoint(run_dir: Path) -> None:
    """What a crash during a disk flush can leave: the newest checkpoint's weights cut to a third."""
    newest = sorted(run_dir.glob("artifacts/train/*/checkpoints/step-*"))[-1] / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 3])


def kill_chain(chain: list[Moment], run_dir: Path, overrides: list[str], env: dict[str, str],
               reference: Reference) -> list[Outcome]:
    """One run dir, killed at each moment in turn (each kill hits a rerun of the run before), then run to the end.

    The last outcome carries the checks of the completed run dir; every outcome says what its kill hit.
    """
    args = run_args(run_dir, overrides)
    outcomes: list[Outcome] = []
    finished: set[str] = set()
    for moment in chain:
        killed = run_once(args, env, kill=moment)
        outcome = Outcome(moment, hit_stage(killed) if killed.returncode == -signal.SIGKILL else "none")
        outcome.checkpoint = newest_checkpoint(run_dir)
        load_log = run_dir / "logs" / "target_loads.jsonl"
        outcome.loads = len(load_log.read_text().splitlines()) if load_log.is_file() else 0
        outcome.redone = _redone(finished, killed.printed)
        outcome.problems += [f"finished stage {s} was computed again" for s in outcome.redone]
        if killed.returncode != -signal.SIGKILL:
            outcome.problems.append(f"the run ended ({killed.returncode}) before the kill: {killed.output[-2000:]}")
        finished |= {label for label, line in zip(_labels(killed.printed), killed.printed) if line.endswith(("Completed", "Cached"))}
        outcomes.append(outcome)
    attempts, final = run_until_complete(args, env)
    last = outcomes[-1]
    last.attempts = attempts
    if final.returncode != 0:
        last.problems.append(f"no rerun completed in {attempts} attempts: {final.output[-3000:]}")
        return outcomes
    last.redone += _redone(finished, final.printed)
    last.problems += [f"finished stage {s} was computed again" for s in _redone(finished, final.printed)]
    last.problems += check_run_dir(run_dir, reference)
    return outcomes


def newest_checkpoint(run_dir: Path) -> int | None:
    """The step of the newest valid checkpoint of the run's training (what a rerun resumes from), None if none."""
    found = [c for folder in run_dir.glob("artifacts/train/*/checkpoints") if (c := latest_valid_checkpoint(folder))]
    return max((c.step for c in found), default=None)


def trained_from(run_dir: Path) -> int | None:
    """The step the completed train stage of the run resumed from (its completion marker), None if it started fresh."""
    summary = json.loads((run_dir / "summary.json").read_text())
    artifact = next(ROOT / row["artifact"] for row in summary["stages"] if row["name"] == "train")
    step = read_complete(artifact).stats["resumed_from_step"]
    return None if step < 0 else step


def _redone(finished: set[str], printed: list[str]) -> list[str]:
    return [label for label, line in zip(_labels(printed), printed)
            if label in finished and not label.startswith("gpu_cleanup") and not line.endswith("Cached")]
