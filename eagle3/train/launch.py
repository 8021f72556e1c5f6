"""Training on several processes from the train stage: torchrun over eagle3.train.ddp.

`train.num_processes` decides how many processes train on each machine ("auto": every visible
GPU, or one per GPU of train.devices, which the ranks are then restricted to; 1 on the CPU), `train.nnodes` on how many machines. One process on one machine calls
train_draft directly. More launch torchrun (`torch.distributed.run`, the launcher PyTorch ships;
nothing hand-made spawns ranks) with this module as the program: each rank reads the same launch
spec, calls train_draft, and eagle3.train.ddp deals the micro-batches; training rank 0 (on the
stage's machine) writes checkpoints, losses.jsonl and evals.jsonl, as a single process would,
then the result as JSON for the stage.

One machine (`--standalone`):

    python -m torch.distributed.run --standalone --nproc-per-node N -m eagle3.train.launch SPEC.json

Several machines: the stage's machine is node 0. It writes the spec to `<out_dir>/.launch-nodes.json`,
prints the command for the others and starts torchrun with a c10d rendezvous that it hosts
(`is_host=true`: not guessed from the endpoint's host name, which fails behind aliases):

    python -m torch.distributed.run --nnodes M --nproc-per-node N --rdzv-backend c10d
        --rdzv-endpoint HOST:PORT --rdzv-id eagle3-<out_dir name>
        --rdzv-conf is_host=true,join_timeout=T -m eagle3.train.launch SPEC.json

Each other machine runs `eagle3 train-node --spec SPEC.json --node-rank R` (join_training): the same
torchrun with `is_host=false`. torchrun's `--node-rank` is not passed: the c10d rendezvous ignores it
and numbers the machines by host name; the node rank reaches the ranks as EAGLE3_NODE_RANK instead
(eagle3.train.ddp). Every machine must see the artifacts folder (data, target, out_dir, the spec) at
the same path: a shared folder. If the others do not join within `train.rdzv_join_timeout`, torchrun
gives up and the stage fails with a TrainError that says what to start where.

The ranks write to the stage's stdout/stderr (file descriptors 1 and 2), which the Prefect task
sends to the run log (those of another machine to its `eagle3 train-node`'s). torchrun is started
with PR_SET_PDEATHSIG: if the process that launched it dies (SIGKILL of the flow), the kernel sends
torchrun SIGTERM and torchrun stops its ranks, so no rank outlives the run. The next run resumes
from the last checkpoint with any number of processes and machines that divides `train.grad_accum`.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eagle3.artifacts import atomic_write_text
from eagle3.train import ddp
from eagle3.train.trainer import LOSSES, TrainConfig, TrainError, TrainResult, train_draft
from eagle3.train.config import effective_grad_accum
from eagle3.gpu.devices import cuda_visible

log = logging.getLogger(__name__)

RESULT = ".train-result.json"
NODES_SPEC = ".launch-nodes.json"  # the spec of a training on several machines: a name the others can be told
STARTED = ".train-started"  # node 0's first rank writes it when it starts: the rendezvous completed
POLL_SECONDS = 0.25  # between two looks at losses.jsonl while the ranks train


def resolve_num_processes(config: TrainConfig) -> int:
    """How many processes train on each machine: `train.num_processes`, "auto" = every visible GPU (1 on the CPU).

    Raises TrainError naming the setting when it cannot be honoured here (or DistError when
    train.grad_accum does not split over train.nnodes x that many)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    every = max(gpus, 1) if config.devices == "auto" else len(config.devices)  # train.devices: one process each
    n = every if config.num_processes == "auto" else int(config.num_processes)
    if gpus and n > gpus:
        raise TrainError(f"train.num_processes={n}, but {gpus} GPU(s) are visible (CUDA_VISIBLE_DEVICES); "
                         f"set train.num_processes to at most {gpus}, or 'auto'")
    ranks = n * config.nnodes
    ddp.check_grad_accum(effective_grad_accum(config, gpus > 0, ranks), ddp.DistContext(world_size=ranks))
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


@dataclass(frozen=True)
class LaunchSpec:
    """What the ranks of every machine read: the settings, the paths, and how the machines meet."""

    config: TrainConfig
    out_dir: Path
    processes: int  # ranks per machine
    paths: dict[str, Path | None] = field(default_factory=dict)  # train_draft's store_dir, target_dir, ...
    stop_after: int | None = None

    @property
    def rdzv_id(self) -> str:  # one training: the same on every machine, and across resumes (a fresh store each)
        return f"eagle3-{self.out_dir.name}"

    def write(self, path: Path) -> None:
        paths = {k: (str(v) if v is not None else None) for k, v in self.paths.items()}
        atomic_write_text(path, json.dumps({"config": self.config.model_dump(mode="json"), "out_dir": str(self.out_dir),
                                            "processes": self.processes, "stop_after": self.stop_after, "paths": paths}))

    @classmethod
    def read(cls, path: Path) -> LaunchSpec:
        try:
            fields = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise TrainError(f"cannot read the launch spec {path} ({err}); it exists while node 0's train stage "
                             "waits for the other machines, in its out_dir on the shared folder") from err
        return cls(config=TrainConfig.model_validate(fields["config"]), out_dir=Path(fields["out_dir"]),
                   processes=int(fields["processes"]), stop_after=fields["stop_after"],
                   paths={k: (Path(v) if v is not None else None) for k, v in fields["paths"].items()})


def _torchrun_command(spec: LaunchSpec, spec_path: Path, node_rank: int) -> list[str]:
    """torchrun for machine `node_rank` (0: the stage's, which hosts the c10d rendezvous)."""
    config = spec.config
    if config.nnodes == 1:
        where = ["--standalone"]
    else:
        host = "true" if node_rank == 0 else "false"
        where = ["--nnodes", str(config.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", str(config.rdzv_endpoint),
                 "--rdzv-id", spec.rdzv_id, "--rdzv-conf", f"is_host={host},join_timeout={config.rdzv_join_timeout}"]
    return [sys.executable, "-m", "torch.distributed.run", *where, "--nproc-per-node", str(spec.processes),
            "-m", "eagle3.train.launch", str(spec_path)]


def node_command(spec_path: Path, node_rank: int) -> str:
    """What to run on machine `node_rank` so that it joins the training of `spec_path`."""
    return f"eagle3 train-node --spec {shlex.quote(str(spec_path))} --node-rank {node_rank}"


def _start(spec: LaunchSpec, spec_path: Path, node_rank: int) -> subprocess.Popen:
    env = dict(os.environ)
    env[ddp.NODE_RANK_ENV] = str(node_rank)
    if (devices := cuda_visible(spec.config.devices)) is not None:  # train.devices: rank r on the r-th of them
        env["CUDA_VISIBLE_DEVICES"] = devices
    if not torch.cuda.is_available():  # ranks share the CPU's cores instead of each taking all of them
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.processes))
    return subprocess.Popen(_torchrun_command(spec, spec_path, node_rank), env=env, preexec_fn=_die_with_parent)


def train_distributed(config: TrainConfig, processes: int, *, out_dir: Path,
                      progress: Callable[[int, int, float], None] | None = None, stop_after: int | None = None,
                      **paths: Path | None) -> TrainResult:
    """train_draft on `processes` ranks per machine under torchrun, this machine being node 0 of
    `config.nnodes`; same arguments (`paths`: store_dir, target_dir, head_path, vocab_path,
    heldout_store_dir, init_from) and result. With several machines it waits for the others to
    join (see join_training) and does not start them."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = LaunchSpec(config, out_dir.absolute(), processes,  # absolute: other machines read them, from elsewhere
                      {k: (Path(v).absolute() if v is not None else None) for k, v in paths.items()}, stop_after)
    spec_path = spec.out_dir / (NODES_SPEC if config.nnodes > 1 else f".launch-{os.getpid()}.json")
    for stale in (RESULT, STARTED):
        (out_dir / stale).unlink(missing_ok=True)
    spec.write(spec_path)
    if config.nnodes > 1:
        _announce(config, spec_path)
    started = time.monotonic()
    try:
        proc = _start(spec, spec_path, 0)
        try:
            code = _wait(proc, out_dir / LOSSES, config.steps, progress)
        except BaseException:  # Ctrl-C or an error in this process: the ranks stop with it
            proc.terminate()
            proc.wait()
            raise
    finally:
        spec_path.unlink(missing_ok=True)
        joined = (out_dir / STARTED).exists()
        (out_dir / STARTED).unlink(missing_ok=True)
    if code != 0:
        raise _failure(config, processes, code, joined, time.monotonic() - started, spec_path)
    return _read_result(out_dir)


def _announce(config: TrainConfig, spec_path: Path) -> None:
    """The command line each other machine must run, where the user (and the run log) sees it."""
    commands = "\n".join(f"  {node_command(spec_path, r)}" for r in range(1, config.nnodes))
    message = (f"train.nnodes={config.nnodes}: this machine is node 0 and waits up to train.rdzv_join_timeout="
               f"{config.rdzv_join_timeout} s for the others at the rendezvous {config.rdzv_endpoint}. Start on the "
               f"other machine(s), one command each:\n{commands}\n(each must read {spec_path.parent} at this same "
               "path: the artifacts folder on a shared folder)")
    log.info(message)
    print(message, file=sys.stderr, flush=True)


def _failure(config: TrainConfig, processes: int, code: int, joined: bool, seconds: float,
             spec_path: Path) -> TrainError:
    """The stage's error for torchrun's exit `code`; `joined`: the rendezvous completed (node 0's first rank ran)."""
    if config.nnodes > 1 and not joined:
        endpoint = f"the rendezvous at train.rdzv_endpoint={config.rdzv_endpoint}"
        ranks = f" (--node-rank 1 .. {config.nnodes - 1}, one per machine)" if config.nnodes > 2 else ""
        join = (f"start `{node_command(spec_path, 1)}` on the other machine(s){ranks}: the stage writes that spec "
                "when it starts, on the shared folder that every machine must see at that path")
        if seconds >= config.rdzv_join_timeout:
            return TrainError(f"train.nnodes={config.nnodes}: the other machine(s) did not join {endpoint} within "
                              f"train.rdzv_join_timeout={config.rdzv_join_timeout} s (torchrun exited with code {code}). "
                              f"Run the stage again and, while it waits, {join}. Or set train.nnodes=1 to train on "
                              "this machine alone")
        return TrainError(f"train.nnodes={config.nnodes}: {endpoint} failed after {seconds:.0f} s, before the other "
                          f"machine(s) joined (torchrun exited with code {code}; its output in the run log says why: "
                          "a port in use, an address that is not this machine's). Fix train.rdzv_endpoint, run the "
                          f"stage again and, while it waits, {join}")
    where = "are in the run log"
    if config.nnodes > 1:
        where = "on this machine are in the run log, those of the others in their `eagle3 train-node` output"
    return TrainError(f"training on {processes} processes x {config.nnodes} machine(s) (torchrun) failed with exit "
                      f"code {code}; the ranks' outputs {where}. Set train.num_processes=1 and train.nnodes=1 to "
                      "train in one process")


def join_training(spec_path: Path, node_rank: int) -> None:
    """Run machine `node_rank` (1 .. train.nnodes-1) of the training that node 0's train stage is
    waiting with, from the spec it wrote (`eagle3 train-node`); returns when that training ends.

    Raises TrainError when the spec or a path in it cannot be read here, when `node_rank` is not
    one of the others', or when torchrun fails (the ranks' output is this process's)."""
    spec_path = Path(spec_path).absolute()
    spec = LaunchSpec.read(spec_path)
    _check_node(spec, spec_path, node_rank)
    print(f"eagle3 train-node: node {node_rank} of train.nnodes={spec.config.nnodes}, {spec.processes} rank(s) here, "
          f"rendezvous {spec.config.rdzv_endpoint}", file=sys.stderr, flush=True)
    proc = _start(spec, spec_path, node_rank)
    try:
        code = proc.wait()
    except BaseException:  # Ctrl-C: the ranks here stop with it (and node 0's fail at their next step)
        proc.terminate()
        proc.wait()
        raise
    if code != 0:
        raise TrainError(f"node {node_rank}: torchrun failed with exit code {code} (its output is above). If the "
                         f"rendezvous did not complete: is node 0's train stage running and waiting, and is "
                         f"train.rdzv_endpoint={spec.config.rdzv_endpoint} reachable from this machine?")


def _check_node(spec: LaunchSpec, spec_path: Path, node_rank: int) -> None:
    nnodes = spec.config.nnodes
    if nnodes < 2:
        raise TrainError(f"{spec_path} launches train.nnodes={nnodes} machine: there is no other node to join")
    if not 1 <= node_rank < nnodes:
        raise TrainError(f"--node-rank is {node_rank}; expected 1 .. {nnodes - 1} for train.nnodes={nnodes} "
                         "(node 0 is the machine that runs the train stage)")
    if spec_path.resolve().parent != spec.out_dir.resolve():
        raise TrainError(f"this machine reads the spec at {spec_path}, but node 0 trains into {spec.out_dir}: mount "
                         "the shared folder at the same path as on node 0")
    for name, path in spec.paths.items():
        if path is not None and not path.exists():
            raise TrainError(f"{name} {path} (from node 0) is not on this machine: every machine must see the "
                             "artifacts folder at the same path (a shared folder)")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and spec.processes > gpus:
        raise TrainError(f"node 0 trains with {spec.processes} processes per machine (train.num_processes), but "
                         f"{gpus} GPU(s) are visible here; every machine needs as many")


def _write_result(out_dir: Path, result: TrainResult) -> None:
    fields = asdict(result)
    for key in ("checkpoint", "best_checkpoint"):  # relative: the stage reads them under its own out_dir
        fields[key] = str(Path(fields[key]).relative_to(out_dir)) if fields[key] is not None else None
    atomic_write_text(out_dir / RESULT, json.dumps(fields))


def _read_result(out_dir: Path) -> TrainResult:
    path = out_dir / RESULT
    if not path.is_file():
        raise TrainError(f"torchrun exited 0 but rank 0 wrote no {path}")
    fields = json.loads(path.read_text())
    path.unlink()
    for key in ("checkpoint", "best_checkpoint"):
        fields[key] = out_dir / fields[key] if fields[key] is not None else None
    return TrainResult(**fields)


def main(spec_path: str) -> int:
    spec = LaunchSpec.read(Path(spec_path))
    if os.environ.get(ddp.NODE_RANK_ENV, "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0":
        atomic_write_text(spec.out_dir / STARTED, "")  # torchrun starts the ranks once every machine has joined
    try:
        ctx = ddp.context_from_env()
        result = train_draft(spec.config, out_dir=spec.out_dir, stop_after=spec.stop_after, **spec.paths)
        if ctx.is_main:
            _write_result(spec.out_dir, result)
    finally:
        ddp.leave()
    return 0


if __name__ == "__main__":
    from eagle3.process_exit import exit_after

    exit_after(main, sys.argv[1])
