"""Shared fixtures. Everything is built locally: no hub, no network."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# vLLM in-process (the capture needs the model in this process) with a small CPU KV cache.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache of builtin targets for the whole session (EAGLE3_CACHE_DIR for subprocesses)."""
    path = Path(os.environ.get("EAGLE3_TEST_CACHE") or tmp_path_factory.mktemp("eagle3-cache"))
    os.environ["EAGLE3_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_target(builtin_cache: Path) -> Path:
    from eagle3.data.target import TargetConfig, resolve_model_dir

    return resolve_model_dir(TargetConfig(model="builtin:tiny"), builtin_cache)
