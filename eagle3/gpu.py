"""GPU hygiene: find the processes holding the GPUs, stop those the policy allows, prove it.

`cleanup_gpus(config, run_dir)` is the gpu_cleanup stage:

1. discover holders: processes with a device file matching `device_glob` open or mapped
   (`fuser` when installed, else a /proc/<pid>/fd + /proc/<pid>/maps scan: the same
   answer), plus the processes NVML lists on each GPU;
2. decide per holder with the policy (`mode`): "own" = only processes this pipeline started
   and recorded with `register_own_process` (pid + start time, so a reused PID is never
   taken for ours); "match" = command line matches `match_patterns`; "all" = everything
   (needs `allow_all`). PID 1, this process and its ancestors are never touched;
3. stop: SIGTERM, wait `grace_seconds`, SIGKILL, and wait until each is gone (reaped with
   waitpid when it is our child, else polled in /proc);
4. verify: poll NVML until each GPU's used memory is under its threshold (see
   `eagle3.gpu_nvml`), else raise GpuBusyError naming what still holds the GPUs.

A process is identified by (pid, start time): the start time is field 22 of
/proc/<pid>/stat (clock ticks since boot), which changes when a PID is reused.
Without an NVIDIA driver, steps 1-3 still run on the device files; step 4 is skipped and
the report says "no NVIDIA driver" (or GpuDriverError when `require_gpus`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from glob import glob
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from eagle3.gpu_nvml import (
    MIB,
    GpuMemory,
    NvmlLike,
    NvmlUnavailableError,
    idle_thresholds_mib,
    memory_snapshot,
    open_nvml,
    wait_until_free,
)
from eagle3.gpu_procs import (
    GpuCleanupError,
    OwnProcess,
    ancestors_and_self,
    describe_process,
    is_gone,
    load_own_processes,
    register_own_process,
    scan_with_fuser,
    scan_with_proc,
)
from eagle3.gpu_report import CleanupReport, GpuHolder, ProcessAction, format_report_table

__all__ = [
    "CleanupReport",
    "GpuBusyError",
    "GpuCleanupConfig",
    "GpuCleanupError",
    "GpuDriverError",
    "GpuHolder",
    "OwnProcess",
    "ProcessAction",
    "cleanup_gpus",
    "discover_holders",
    "format_report_table",
    "register_own_process",
]
