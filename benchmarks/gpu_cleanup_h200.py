"""Show gpu_cleanup on a real GPU: a process of ours holds GPU memory, cleanup stops it, NVML proves it.

Run on a machine with an NVIDIA driver (the device tool's H200):
    python benchmarks/gpu_cleanup_h200.py
Prints NVML's used memory before, the cleanup report, and NVML's used memory after; then the
preflight a target load runs (eagle3.gpu.preflight) for a 100 GiB checkpoint (sparse files) while a
stranger holds 60 GiB (refused, with the numbers), and once that holder is gone (passes).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pynvml

from eagle3.gpu.cleanup import GpuCleanupConfig, cleanup_gpus, format_report_table, register_own_process
from eagle3.gpu.nvml import InsufficientGpuMemoryError
from eagle3.gpu.preflight import target_preflight

HOLD = ("import sys, torch, time; x = torch.empty(int(sys.argv[1]) << 30, dtype=torch.uint8, device='cuda'); "
        "print('holding', flush=True); time.sleep(600)")


def used_mib() -> list[int]:
    return [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used >> 20
            for i in range(pynvml.nvmlDeviceGetCount())]


def main() -> None:
    pynvml.nvmlInit()
    run_dir = Path(tempfile.mkdtemp())
    print("NVML used MiB, idle:", used_mib())
    holder = subprocess.Popen([sys.executable, "-c", HOLD, "8"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    time.sleep(1)
    register_own_process(run_dir, holder.pid)
    print(f"NVML used MiB, with pid {holder.pid} holding 8 GiB:", used_mib())
    report = cleanup_gpus(GpuCleanupConfig(mode="own", grace_seconds=5, verify_timeout_seconds=60), run_dir)
    print(format_report_table(report))
    print("NVML used MiB, after cleanup:", used_mib(), "; holder exit code:", holder.poll())
    preflight_demo(run_dir)


def preflight_demo(run_dir: Path) -> None:
    target = run_dir / "target-100g"
    target.mkdir()
    for i in range(4):  # 4 x 25 GiB of weights, sparse: no disk used
        with open(target / f"model-0000{i + 1}-of-00004.safetensors", "wb") as handle:
            handle.truncate(25 << 30)
    stranger = subprocess.Popen([sys.executable, "-c", HOLD, "60"], stdout=subprocess.PIPE, text=True)
    assert stranger.stdout is not None and stranger.stdout.readline().strip() == "holding"
    time.sleep(1)
    print(f"\nNVML used MiB, a stranger (pid {stranger.pid}) holding 60 GiB:", used_mib())
    try:
        target_preflight(target, tensor_parallel_size=1, kv_cache_gib=20)
        print("preflight passed (unexpected)")
    except InsufficientGpuMemoryError as err:
        print("preflight refused the load:", err)
    stranger.kill()
    stranger.wait()
    time.sleep(2)
    print("NVML used MiB, stranger gone:", used_mib())
    print("preflight:", target_preflight(target, tensor_parallel_size=1, kv_cache_gib=20))


if __name__ == "__main__":
    main()
