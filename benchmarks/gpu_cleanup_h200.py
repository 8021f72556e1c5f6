"""Show gpu_cleanup on a real GPU: a process of ours holds GPU memory, cleanup stops it, NVML proves it.

Run on a machine with an NVIDIA driver (the device tool's H200):
    python benchmarks/gpu_cleanup_h200.py
Prints NVML's used memory before, the cleanup report, and NVML's used memory after.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pynvml

from eagle3.gpu import GpuCleanupConfig, cleanup_gpus, format_report_table, register_own_process

HOLD = "import torch, time; x = torch.empty(8 << 30, dtype=torch.uint8, device='cuda'); print('holding', flush=True); time.sleep(600)"


def used_mib() -> list[int]:
    return [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used >> 20
            for i in range(pynvml.nvmlDeviceGetCount())]


def main() -> None:
    pynvml.nvmlInit()
    run_dir = Path(tempfile.mkdtemp())
    print("NVML used MiB, idle:", used_mib())
    holder = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    time.sleep(1)
    register_own_process(run_dir, holder.pid)
    print(f"NVML used MiB, with pid {holder.pid} holding 8 GiB:", used_mib())
    report = cleanup_gpus(GpuCleanupConfig(mode="own", grace_seconds=5, verify_timeout_seconds=60), run_dir)
    print(format_report_table(report))
    print("NVML used MiB, after cleanup:", used_mib(), "; holder exit code:", holder.poll())


if __name__ == "__main__":
    main()
