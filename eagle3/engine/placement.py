"""Where the target engine and the trainer run on a CPU machine (train.data online/hybrid): cores of their own.

Online training runs the warm engine (a process of its own, eagle3.engine.server) and the trainer side by side.
Left alone, both would spread their OpenMP threads over every core and take turns on each. `split_cpus` gives the
engine the first `online.engine_cpus` of the CPUs this process may use and the trainer the rest; `pin_process`
pins every thread of the engine process (its OpenMP workers are already started, so each thread is set, not only
the main one), and `trainer_on` does the same for this process while training, with torch's intra-op thread count
set to its share, and puts both back afterwards.

On the CPU build of vLLM the engine runs in one process (the uni executor) whose threads all live under its pid.
With CUDA nothing is pinned here: target.devices and train.devices place the engine and the trainer on GPUs
(eagle3.gpu.devices).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Literal


class PlacementError(ValueError):
    """online.engine_cpus cannot be honoured on this machine; the message names the setting."""


def split_cpus(engine_cpus: int | Literal["auto"], available: set[int] | None = None
               ) -> tuple[frozenset[int], frozenset[int]] | None:
    """(engine's CPUs, trainer's CPUs) from the CPUs this process may use, or None (no pinning: 0, or 'auto' with
    fewer than 2 CPUs). 'auto' gives the engine half, rounded down, at least 1."""
    cpus = sorted(os.sched_getaffinity(0) if available is None else available)
    count = max(1, len(cpus) // 2) if engine_cpus == "auto" else int(engine_cpus)
    if count == 0 or (engine_cpus == "auto" and len(cpus) < 2):
        return None
    if count >= len(cpus):
        raise PlacementError(f"online.engine_cpus={engine_cpus} leaves the trainer no core: this process may use "
                             f"{len(cpus)} CPUs ({cpus}); set online.engine_cpus below {len(cpus)}, or 0 to share them")
    return frozenset(cpus[:count]), frozenset(cpus[count:])


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def _set(tid: int, cpus: frozenset[int] | set[int]) -> None:
    with contextlib.suppress(OSError):  # a thread that ended between listing and setting
        os.sched_setaffinity(tid, cpus)


def pin_process(pid: int, cpus: frozenset[int]) -> None:
    """Every thread of process `pid` (and the threads it starts later, which inherit the mask) on `cpus`."""
    for tid in _threads(pid):
        _set(tid, cpus)


def affinity(pid: int) -> set[int]:
    """The union of the CPUs the threads of `pid` may use (what a test or a user checks)."""
    out: set[int] = set()
    for tid in _threads(pid):
        with contextlib.suppress(OSError):
            out |= os.sched_getaffinity(tid)
    return out


@contextlib.contextmanager
def trainer_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """This process's threads on `cpus`, torch's intra-op threads one per CPU, while the block runs (None: as is)."""
    if cpus is None:
        yield
        return
    import torch

    mine = os.sched_getaffinity(0)  # the calling thread's: what threads started meanwhile get back
    before: dict[int, set[int]] = {}
    for tid in _threads(os.getpid()):
        with contextlib.suppress(OSError):
            before[tid] = os.sched_getaffinity(tid)
    threads = torch.get_num_threads()
    pin_process(os.getpid(), cpus)
    torch.set_num_threads(len(cpus))
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        for tid in _threads(os.getpid()):
            _set(tid, before.get(tid, mine))
