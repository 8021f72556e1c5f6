"""regenerate.endpoint against a real `vllm serve` (python -m vllm.entrypoints.openai.api_server) of the tiny target,
started here on 127.0.0.1 with an API key: the same greedy answers as in-process regeneration, and the checks
that refuse a server of another model or tokenizer before any request."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from eagle3.capture import vllm_adapter
from eagle3.capture.regenerate import RegenerateConfig, regenerate
from eagle3.data.conversations import (
    DataConfig,
    Message,
    _template_ids,
    load_conversations,
)
from eagle3.engine.endpoint import EndpointError, open_endpoint
from tests.on_device import KV_CACHE_GIB

KEY_ENV = "EAGLE3_TEST_ENDPOINT_KEY"


@pytest.fixture(scope="module")
def server(tiny_target: Path, tmp_path_factory) -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(tmp_path_factory.mktemp("endpoint") / "server.log", "w")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_target),
                             "--dtype", "float32", "--max-model-len", "256", "--host", "127.0.0.1", "--port", str(port),
                             "--enforce-eager", "--api-key", "sekret",
                             "--kv-cache-memory-bytes", str(int(KV_CACHE_GIB * 2**30))], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None, Path(log.name).read_text()[-3000:]
            time.sleep(1)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("vllm api_server did not answer /health in 240 s")
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_target: Path):  # noqa: ANN201
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target)


def _open(url: str, tiny_target: Path, real, **changes):  # noqa: ANN001, ANN202
    args = {"target_model": "builtin:tiny", "model_dir": str(tiny_target), "max_model_len": 256, "tokenizer": real,
            "template_ids": lambda chat: _template_ids(real, [Message(m["role"], m["content"]) for m in chat], True)}
    return open_endpoint(url, KEY_ENV, **(args | changes))


def test_the_endpoint_gives_the_same_greedy_answers_as_in_process_regeneration(server, tiny_target, tokenizer, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sekret")
    chats = [c for c in load_conversations(DataConfig(max_samples=12)) if any(m.role == "assistant" for m in c.messages)]
    config = RegenerateConfig(max_new_tokens=24, endpoint=server, api_key_env=KEY_ENV)
    finished = []
    served = regenerate(chats, tokenizer, lambda: _open(server, tiny_target, tokenizer), config, 256,
                        progress=lambda done, total, tokens: finished.append(done))
    spec = vllm_adapter.EngineSpec(model_dir=str(tiny_target), dtype="float32", max_model_len=256, kv_cache_gib=KV_CACHE_GIB,
                                   tensor_parallel_size=1, trust_remote_code=False, seed=0)
    try:
        local = regenerate(chats, tokenizer, lambda: vllm_adapter.acquire(spec), config, 256)
    finally:
        vllm_adapter.release_all()
    assert len(served.conversations) == len(chats) and served.generated_tokens > 0
    assert served.conversations == local.conversations and served.generated_tokens == local.generated_tokens
    assert finished[-1] == len(chats)


def test_a_server_of_another_model_or_tokenizer_or_without_the_key_is_refused_before_any_request(
        server, tiny_target, tokenizer, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sekret")
    with pytest.raises(EndpointError, match=r"serves .*tiny-llama.*expected the target /models/other"):
        _open(server, tiny_target, tokenizer, target_model="/models/other", model_dir="/models/other")
    with pytest.raises(EndpointError, match="max_model_len 256 < target.max_model_len=512"):
        _open(server, tiny_target, tokenizer, max_model_len=512)

    class Shifted:  # a tokenizer whose ids differ from the server's
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [i + 1 for i in tokenizer.encode(text, add_special_tokens=add_special_tokens)]

    with pytest.raises(EndpointError, match="tokenizer's text ids for a probe differ"):
        _open(server, tiny_target, tokenizer, tokenizer=Shifted())
    monkeypatch.setenv(KEY_ENV, "wrong")
    with pytest.raises(EndpointError, match="HTTP 401.*regenerate.api_key_env"):
        _open(server, tiny_target, tokenizer)
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(EndpointError, match=f"regenerate.api_key_env='{KEY_ENV}': the environment variable"):
        _open(server, tiny_target, tokenizer)
    with pytest.raises(EndpointError, match="failed .*expected a running OpenAI-compatible server"):
        open_endpoint("http://127.0.0.1:9", None, target_model="x", model_dir="x", max_model_len=1, tokenizer=tokenizer,
                      template_ids=lambda chat: [])


def test_the_regenerate_stage_with_an_endpoint_loads_no_target_and_says_where_it_regenerated(
        server, builtin_cache, tmp_path, monkeypatch):
    import json

    from eagle3 import stages
    from eagle3.data.target import TargetConfig

    monkeypatch.setenv(KEY_ENV, "sekret")
    target_config = TargetConfig(model="builtin:tiny", max_model_len=256, dtype="float32", kv_cache_gib=KV_CACHE_GIB)
    target = stages.run_stage_target(target_config, builtin_cache, tmp_path, stages.fingerprint_target(target_config))
    data, config = DataConfig(max_samples=6), RegenerateConfig(max_new_tokens=8, endpoint=server, api_key_env=KEY_ENV)
    fp = stages.fingerprint_regenerate(config, data, target, 256)
    assert fp == stages.fingerprint_regenerate(RegenerateConfig(max_new_tokens=8), data, target, 256)  # same artifact
    record = stages.run_regenerate(config, data, target_config, target, tmp_path, fp, tmp_path / "loads.jsonl")
    assert record.stats["regenerated"] == 1 and record.stats["generated_tokens"] > 0
    (line,) = [json.loads(x) for x in (tmp_path / "loads.jsonl").read_text().splitlines()]
    assert line["event"] == "endpoint" and line["url"] == server and vllm_adapter._POOL == {}
