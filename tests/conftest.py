"""Shared fixtures. Everything is built locally: no hub, no network."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# vLLM in-process (the capture needs the model in this process). The KV cache's size is each engine's own
# kv_cache_gib (tests.on_device.KV_CACHE_GIB): no VLLM_CPU_KVCACHE_SPACE here, which would override it in vLLM.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One cache of builtin targets for the whole session (EAGLE3_CACHE_DIR for subprocesses)."""
    shared = os.environ.get("EAGLE3_TEST_CACHE")  # a developer's cache, maybe shared by xdist workers: left alone
    path = Path(shared or tmp_path_factory.mktemp("eagle3-cache"))
    os.environ["EAGLE3_CACHE_DIR"] = str(path)
    yield path
    if not shared:
        _stop_leftover_engines(path)


def _stop_leftover_engines(cache: Path) -> None:
    """No warm engine outlives the session: one a test left would hold its memory (a whole GPU under make test-gpu)
    for keep_warm_s after pytest exits. Each test stops its own; this names and stops any that one missed."""
    import warnings

    from eagle3.engine.client import stop_engine
    from eagle3.engine.registry import live_engines

    for home, info in live_engines(cache):
        warnings.warn(f"a test left the warm engine {home.fingerprint} (pid {info['pid']}) running: stopped it",
                      stacklevel=1)
        stop_engine(home, info)


@pytest.fixture(scope="session")
def tiny_target(builtin_cache: Path) -> Path:
    from eagle3.data.target import TargetConfig, resolve_model_dir

    return resolve_model_dir(TargetConfig(model="builtin:tiny"), builtin_cache)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Test files longest first (tests/file_seconds.json, measured; scripts/file_seconds.py writes it), the others
    after them as collected. make test hands whole files to its 2 processes in this order (xdist's loadfile with
    --no-loadscope-reorder): the long end-to-end files start first and the short ones fill in at the end. In xdist's
    own order, files with the most tests first, the long files came last, and one process ran the last of them
    while the other had nothing left."""
    seconds = json.loads((Path(__file__).parent / "file_seconds.json").read_text())
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0))  # stable: a file's own order is kept


def pytest_report_header(config: pytest.Config) -> list[str]:  # noqa: ARG001 - pytest's hook signature
    """On CUDA (make test-gpu), the versions the results belong to."""
    from tests.on_device import DTYPE, ON_CUDA

    if not ON_CUDA:
        return []
    import torch

    try:
        from importlib.metadata import version

        vllm = version("vllm")
    except Exception as err:  # noqa: BLE001 - the header only reports
        vllm = f"not installed ({type(err).__name__})"
    return [f"device: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, vllm {vllm}, vLLM tests in {DTYPE}"]


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001, ARG001 - pytest's hook
    """The closeness figures the vLLM tests measured (tests/on_device.report), so a run's log shows the numbers."""
    from tests.on_device import MEASURED

    if MEASURED:
        terminalreporter.section("measured on this device")
        for line in MEASURED:
            terminalreporter.write_line(line)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With EAGLE3_TEST_FAILURES=<file>, each failure's traceback is appended there as it happens, so a run stopped
    at a time limit (a device's call, CI's) still tells what failed."""
    path = os.environ.get("EAGLE3_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a") as handle:
            handle.write(f"\n==== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
