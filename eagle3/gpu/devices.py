"""GPU placement on one machine: which GPUs the target engine takes (`target.devices`) and which the trainer takes
(`train.devices`).

A device is named as CUDA_VISIBLE_DEVICES of this process names it: with CUDA_VISIBLE_DEVICES=4,5,6,7 the four GPUs
are 4, 5, 6 and 7 (and torch calls them cuda:0..3); without it, 0..N-1. 'auto' (the default) places nothing: the
engine and the trainer see every GPU this process sees, as before these settings.

- The engine process is started with CUDA_VISIBLE_DEVICES set to `target.devices` (eagle3.engine.client), so its
  tensor-parallel ranks take exactly those GPUs; data-parallel extraction engines split them among themselves.
- The trainer, one process, trains on the first of `train.devices` (`trainer_cuda_index`: torch's index of it);
  several training processes (train.num_processes, store mode only) are launched with CUDA_VISIBLE_DEVICES set to
  all of them.

`placement_problems` is what a run refuses before any load: devices on a machine without CUDA, a device that is not
visible, an engine whose GPUs are not its TP x DP ranks, a trainer whose GPUs are not its processes, and (online and
hybrid, where the engine keeps its GPUs while the trainer trains) devices that both take.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Literal

Devices = list[int] | Literal["auto"]


def check_devices(value: Devices, setting: str) -> Devices:
    """A pydantic validator's body: a non-empty list of distinct indices >= 0, or 'auto'."""
    if value == "auto":
        return value
    if not value:
        raise ValueError(f"{setting} is []; expected GPU indices (e.g. [0, 1]) or 'auto' (every visible GPU)")
    if any(d < 0 for d in value) or len(set(value)) != len(value):
        raise ValueError(f"{setting}={value}; expected distinct GPU indices >= 0 as CUDA_VISIBLE_DEVICES names them, "
                         "or 'auto'")
    return value


def visible_gpus() -> list[str]:
    """The GPU ids this process may use, as CUDA_VISIBLE_DEVICES names them (empty on a machine without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named:
        return [g.strip() for g in named.split(",") if g.strip()][: torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


def cuda_visible(devices: Devices) -> str | None:
    """CUDA_VISIBLE_DEVICES for a process placed on `devices` (None: 'auto', inherit this process's)."""
    return None if devices == "auto" else ",".join(str(d) for d in devices)


def trainer_cuda_index(devices: Devices, visible: Sequence[str]) -> int | None:
    """torch's index (cuda:i) of the trainer's GPU, the first of `devices` (None: 'auto', torch's default)."""
    if devices == "auto":
        return None
    return list(visible).index(str(devices[0]))


@contextlib.contextmanager
def trainer_on_gpu(devices: Devices) -> Iterator[None]:
    """This thread's current CUDA device is the trainer's (train.devices' first) while the block runs; 'auto' or no
    CUDA: as is. The single-process trainer takes the current device (eagle3.train.ddp.device_for)."""
    import torch

    if devices == "auto" or not torch.cuda.is_available():
        yield
        return
    with torch.cuda.device(trainer_cuda_index(devices, visible_gpus())):
        yield


def placement_problems(*, target_devices: Devices, train_devices: Devices, engine_gpus: int, train_processes: int,
                       online: bool, visible: Sequence[str] | None, engine_cpus: int | str = "auto") -> list[str]:
    """Why `target.devices` / `train.devices` cannot be honoured (an empty list: they can); and `online.engine_cpus`
    (`engine_cpus`), the CPU build's placement, set on a machine with CUDA, where nothing would read it.

    `engine_gpus`: target.tensor_parallel_size x target.data_parallel_size; `train_processes`: the training
    processes on this machine (train.num_processes resolved); `visible`: visible_gpus(), or None when the hardware
    is not known yet (the settings alone are checked: a config built where it will not run)."""
    problems = []
    given = [(name, d) for name, d in (("target.devices", target_devices), ("train.devices", train_devices))
             if d != "auto"]
    if target_devices != "auto" and len(target_devices) != engine_gpus:
        problems.append(f"target.devices={target_devices} gives the engine {len(target_devices)} GPU(s), but it runs "
                        f"target.tensor_parallel_size x target.data_parallel_size = {engine_gpus} rank(s), one GPU each; "
                        f"list {engine_gpus} GPU(s) in target.devices, or change target.tensor_parallel_size")
    if train_devices != "auto" and online and len(train_devices) != 1:
        problems.append(f"train.devices={train_devices} gives the trainer {len(train_devices)} GPUs, but with train.data "
                        "online/hybrid one process trains (the feed serves one); list one GPU in train.devices")
    elif train_devices != "auto" and len(train_devices) != train_processes:
        problems.append(f"train.devices={train_devices} gives the trainer {len(train_devices)} GPU(s), but it runs "
                        f"{train_processes} training process(es) (train.num_processes), one GPU each; list "
                        f"{train_processes} GPU(s) in train.devices, or set train.num_processes={len(train_devices)}")
    if online and target_devices != "auto" and train_devices != "auto":
        both = sorted(set(target_devices) & set(train_devices))
        if both:
            problems.append(f"target.devices={target_devices} and train.devices={train_devices} both take GPU(s) {both}: "
                            "with train.data online/hybrid the engine keeps its GPUs while the trainer trains; give them "
                            "disjoint GPUs")
    if visible is None:
        return problems
    if visible and engine_cpus != "auto":
        problems.append(f"online.engine_cpus={engine_cpus} places the engine on CPU cores, which only the CPU build does; "
                        f"this machine has CUDA (GPUs {', '.join(visible)}), where the engine and the trainer take GPUs "
                        "(target.devices, train.devices); leave online.engine_cpus at 'auto'")
    if not visible and given:
        problems += [f"{name}={d} names GPUs, but this machine has no CUDA (the CPU build); on the CPU build the engine "
                     f"and the trainer get cores of their own (online.engine_cpus); set {name}='auto'" for name, d in given]
    elif visible:
        for name, devices in given:
            unknown = [d for d in devices if str(d) not in visible]
            if unknown:
                problems.append(f"{name}={devices}: GPU(s) {unknown} are not visible to this process (it sees "
                                f"{', '.join(visible)}, as CUDA_VISIBLE_DEVICES names them); set {name} to GPUs among "
                                "those, or 'auto'")
    return problems
