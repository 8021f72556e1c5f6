"""Training on several processes from the train stage: torchrun over eagle3.draft.ddp.

`train.num_processes` decides how many processes train ("auto": every visible GPU, 1 on the
CPU). One process calls train_draft directly. More launch torchrun (`torch.distributed.run
--standalone`, the launcher PyTorch ships; nothing hand-made spawns ranks) with this module
as the program: each rank reads the same launch file, calls train_draft, and eagle3.draft.ddp
deals the micro-batches; rank 0 writes checkpoints, losses.jsonl and evals.jsonl, as a single
process would, then the result as JSON for the stage.

The ranks write to the stage's stdout/stderr (file descriptors 1 and 2), which the Prefect task
sends to the run log. torchrun is started with PR_SET_PDEATHSIG: if the process that launched it
dies (SIGKILL of the flow), the kernel sends torchrun SIGTERM and torchrun stops its ranks, so no
rank outlives the run. The next run resumes from the last checkpoint with any number of
processes that divides `train.grad_accum`.

    python -m torch.distributed.run --standalone --nproc-per-node N -m eagle3.draft.launch LAUNCH.json
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from eagle3.artifacts import atomic_write_text
from eagle3.draft import ddp
from eagle3.draft.train import LOSSES, TrainConfig, TrainError, TrainResult, train_draft

RESULT = ".train-result.json"
POLL_SECONDS = 0.25  # between two looks at losses.jsonl while the ranks train


def resolve_num_processes(config: TrainConfig) -> int:
    """How many processes train: `train.num_processes`, "auto" = every visible GPU (1 on the CPU).

    Raises TrainError naming the setting when it cannot be honoured here."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = max(gpus, 1) if config.num_processes == "auto" else int(config.num_processes)
    if gpus and n > gpus:
        raise TrainError(f"train.num_processes={n}, but {gpus} GPU(s) are visible (CUDA_VISIBLE_DEVICES); "
                         f"set train.num_processes to at most {gpus}, or 'auto'")
    ddp.check_grad_accum(config.grad_accum, ddp.DistContext(world_size=n))
    return n


def _die_with_parent() -> None:  # in the child, between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class _LossFollower:
    """Rank 0's new steps in losses.jsonl, read from where the last look stopped."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.last, self.inode = path, 0, 0, None

    def new_steps(self) -> list[tuple[int, float]]:
        try:
            with open(self.path, "rb") as handle:
                inode = os.fstat(handle.fileno()).st_ino
                if inode != self.inode:  # replaced (rank 0 starts by rewriting it atomically): read from the start
                    self.inode, self.offset = inode, 0
                handle.seek(self.offset)
                data = handle.read()
        except OSError:
            return []
        whole = data[: data.rfind(b"\n") + 1]  # the line being written waits for the next look
        self.offset += len(whole)
        steps = []
        for line in whole.splitlines():
            entry = json.loads(line)
            if entry["step"] > self.last:
                self.last = entry["step"]
                steps.append((entry["step"], entry["loss"]))
        return steps


def _wait(proc: subprocess.Popen, losses: Path, total: int, progress: Callable[[int, int, float], None] | None) -> int:
    """Wait for torchrun, reporting rank 0's steps to `progress` from this thread (the caller's run context)."""
    follower = _LossFollower(losses)
    while True:
        try:
            code = proc.wait(timeout=POLL_SECONDS)
        except subprocess.TimeoutExpired:
            code = None
        for step, loss in follower.new_steps() if progress is not None else []:
            progress(step, total, loss)
        if code is not None:
            return code


def train_distributed(config: TrainConfig, processes: int, *, out_dir: Path,
                      progress: Callable[[int, int, float], None] | None = None, stop_after: int | None = None,
                      **paths: Path | None) -> TrainResult:
    """train_draft on `processes` ranks under torchrun; same arguments (`paths`: store_dir, target_dir,
    head_path, vocab_path, heldout_store_dir, init_from) and result."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = out_dir / f".launch-{os.getpid()}.json"
    (out_dir / RESULT).unlink(missing_ok=True)
    atomic_write_text(spec, json.dumps({"config": config.model_dump(mode="json"), "out_dir": str(out_dir), "stop_after": stop_after,
                                        "paths": {k: (str(v) if v is not None else None) for k, v in paths.items()}}))
    env = dict(os.environ)
    if not torch.cuda.is_available():  # ranks share the CPU's cores instead of each taking all of them
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
               "-m", "eagle3.draft.launch", str(spec)]
    try:
        proc = subprocess.Popen(command, env=env, preexec_fn=_die_with_parent)
        try:
            code = _wait(proc, out_dir / LOSSES, config.steps, progress)
        except BaseException:  # Ctrl-C or an error in this process: the ranks stop with it
            proc.terminate()
            proc.wait()
            raise
    finally:
        spec.unlink(missing_ok=True)
    if code != 0:
        raise TrainError(f"training on {processes} processes (torchrun) failed with exit code {code}; each rank's "
                         "output is in the run log. Set train.num_processes=1 to train in one process")
    return _read_result(out_dir)


def _write_result(out_dir: Path, result: TrainResult) -> None:
    fields = asdict(result)
    for key in ("checkpoint", "best_checkpoint"):
        fields[key] = str(fields[key]) if fields[key] is not None else None
    atomic_write_text(out_dir / RESULT, json.dumps(fields))


def _read_result(out_dir: Path) -> TrainResult:
    path = out_dir / RESULT
    if not path.is_file():
        raise TrainError(f"torchrun exited 0 but rank 0 wrote no {path}")
    fields = json.loads(path.read_text())
    path.unlink()
    for key in ("checkpoint", "best_checkpoint"):
        fields[key] = Path(fields[key]) if fields[key] is not None else None
    return TrainResult(**fields)


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    paths = {k: (Path(v) if v is not None else None) for k, v in spec["paths"].items()}
    out_dir = Path(spec["out_dir"])
    result = train_draft(TrainConfig.model_validate(spec["config"]), out_dir=out_dir, stop_after=spec["stop_after"], **paths)
    if ddp.context_from_env().is_main:
        _write_result(out_dir, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
