"""Preflight: enough free GPU memory for the job (and for a target load) before it starts; FAKE NVML
(tests/eagle3/test_gpu.py's FakeNvml), since this machine has no NVIDIA driver."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3.gpu.nvml import MIB, DeviceMemory, InsufficientGpuMemoryError, preflight, required_bytes_per_gpu
from tests.eagle3.test_gpu import FakeNvml


def test_preflight_names_the_gpu_that_lacks_memory():
    nvml = FakeNvml([81_920, 81_920], idle_mib=0)
    need = required_bytes_per_gpu(60 * 2**30, tensor_parallel_size=2,
                                  kv_cache_bytes_per_gpu=5 * 2**30)
    assert need == 35 * 2**30
    assert [g.index for g in preflight(need, nvml)] == [0, 1]

    class OneBusyGpu(FakeNvml):
        def memory(self, index: int) -> DeviceMemory:
            used = 70 * 1024 if index == 1 else 0
            return DeviceMemory(used_bytes=used * MIB, total_bytes=81_920 * MIB)

    busy = OneBusyGpu([81_920, 81_920])
    with pytest.raises(InsufficientGpuMemoryError,
                       match=r"need 35\.00 GiB .*GPU 1: 10\.00 GiB free of 80\.00 GiB"):
        preflight(need, busy)
    assert [g.index for g in preflight(need, busy, devices=[0])] == [0]
    with pytest.raises(ValueError, match=r"devices \[2\] do not exist"):
        preflight(need, busy, devices=[2])


class BusyGpus(FakeNvml):
    """FAKE NVML: 80 GiB GPUs, with `used_mib[i]` MiB held on GPU i by someone else."""

    def __init__(self, used_mib: list[int]) -> None:
        super().__init__([81_920] * len(used_mib), idle_mib=0)
        self.used_mib = used_mib

    def memory(self, index: int) -> DeviceMemory:
        return DeviceMemory(used_bytes=self.used_mib[index] * MIB, total_bytes=81_920 * MIB)


def _checkpoint(folder: Path, gib: int) -> Path:
    """A target folder whose weight files add up to `gib` GiB (sparse files: no disk used)."""
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    for i in range(2):
        with open(folder / f"model-0000{i + 1}-of-00002.safetensors", "wb") as handle:
            handle.truncate(gib * 2**30 // 2)
    return folder


def test_target_preflight_names_the_short_gpu_and_the_settings_to_change(tmp_path, monkeypatch):
    from eagle3.gpu.preflight import target_preflight

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    model = _checkpoint(tmp_path / "target", gib=40)  # TP 2: 20 GiB of weights per GPU, + 5 GiB of KV cache
    ok = target_preflight(model, 2, 5.0, nvml=BusyGpus([1024, 1024]))
    assert ok["checked"] and ok["need_mib"] == 25 * 1024 and [g["index"] for g in ok["gpus"]] == [0, 1]
    with pytest.raises(InsufficientGpuMemoryError, match=r"GPU 1: 10\.00 GiB free.*target\.tensor_parallel_size=2 "
                       r"\+ target\.kv_cache_gib=5"):
        target_preflight(model, 2, 5.0, nvml=BusyGpus([1024, 70 * 1024]))
    # the served evaluation's engines (vllm_serving.load_serving_engine) name their own KV-cache setting
    with pytest.raises(InsufficientGpuMemoryError, match=r"tensor_parallel_size=2 \+ eval\.served_kv_cache_gib=5"):
        target_preflight(model, 2, 5.0, nvml=BusyGpus([1024, 70 * 1024]), kv_setting="eval.served_kv_cache_gib")
    # The engine takes the GPUs CUDA_VISIBLE_DEVICES names: only those are checked.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    with pytest.raises(InsufficientGpuMemoryError, match=r"GPUs checked: \[1\]"):
        target_preflight(model, 1, 5.0, nvml=BusyGpus([1024, 70 * 1024]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert [g["index"] for g in target_preflight(model, 1, 5.0, nvml=BusyGpus([1024, 70 * 1024]))["gpus"]] == [0]
    # More GPUs asked for than there are: named, not an index error.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(InsufficientGpuMemoryError, match=r"do not exist.*tensor_parallel_size=4"):
        target_preflight(model, 4, 5.0, nvml=BusyGpus([0, 0]))


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this machine has an NVIDIA driver")
def test_target_preflight_without_a_driver_says_so_and_lets_the_cpu_build_run(tmp_path):
    from eagle3.gpu.preflight import target_preflight

    report = target_preflight(_checkpoint(tmp_path / "target", gib=1), 1, 1.0)
    assert report["checked"] is False and "NVIDIA" in str(report["reason"]) and report["need_mib"] == 2048
