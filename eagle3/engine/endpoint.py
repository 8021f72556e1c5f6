"""Regeneration against an OpenAI-compatible server the user already runs (`regenerate.endpoint`).

No target load at all: the prompts are the token ids our own chat template makes (the same as
in-process regeneration), sent to `POST /v1/completions` as token-id prompts with the same
sampling (every sampling field explicit, so a server's generation_config defaults cannot creep
in) and `return_token_ids`, so the answers come back as token ids, decoded here as in-process.

Before any generation request, `open_endpoint` checks the server against the target:
- the model: `GET /v1/models` must list one whose id or root names the target (target.model or
  its folder, or the folder's name), with a max_model_len of at least target.max_model_len;
- the tokenizer: `POST /tokenize` of a probe text (special characters, digits, a non-ASCII word)
  and of a probe conversation through the server's chat template must give exactly our ids.
Any mismatch is one error naming the endpoint, what differs and the setting to change.

Requests go MAX_IN_FLIGHT at a time (the server batches them), each with a timeout; progress
moves as answers finish. The API key, when the server wants one, is read from the environment
variable `regenerate.api_key_env` names, and sent as a bearer token.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

MAX_IN_FLIGHT = 32
REQUEST_TIMEOUT_S = 600.0
CHECK_TIMEOUT_S = 30.0
PROBE_TEXT = "Hello, EAGLE-3 draft!  1234567 ünïcödé\n\ttabs <b>x</b>"


class EndpointError(ValueError):
    """The endpoint cannot serve this target's regeneration; the message names what differs and the setting."""


class EndpointEngine:
    """eagle3.capture.regenerate.TokenGenerator over an OpenAI-compatible server."""

    def __init__(self, url: str, model: str, api_key: str | None) -> None:
        self.url, self.model, self.api_key = url.rstrip("/"), model, api_key

    def call(self, method: str, path: str, body: dict | None = None, timeout_s: float = REQUEST_TIMEOUT_S) -> dict:
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            hint = "; set regenerate.api_key_env to the variable that holds its key" if err.code in (401, 403) else ""
            raise EndpointError(f"regenerate.endpoint={self.url}: {method} {path} answered HTTP {err.code}: {detail}{hint}") from err
        except (urllib.error.URLError, TimeoutError, OSError) as err:
            raise EndpointError(f"regenerate.endpoint={self.url}: {method} {path} failed ({getattr(err, 'reason', err)}); "
                                "expected a running OpenAI-compatible server (vllm serve) at that URL") from err

    def _one(self, prompt: Sequence[int], params: dict) -> list[int]:
        body = {"model": self.model, "prompt": list(prompt), "return_token_ids": True, "stream": False, **params}
        choice = self.call("POST", "/v1/completions", body)["choices"][0]
        if choice.get("token_ids") is None:
            raise EndpointError(f"regenerate.endpoint={self.url}: the completion has no token_ids; expected a vLLM server "
                                "(>= 0.10) that honours return_token_ids")
        return list(choice["token_ids"])

    def generate_ids(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float, top_p: float,
                     seed: int, on_finished: Callable[[int], None] | None = None) -> list[list[int]]:
        params = {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed, "top_k": -1,
                  "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "n": 1}
        out: list[list[int] | None] = [None] * len(prompts)
        with ThreadPoolExecutor(MAX_IN_FLIGHT) as pool:
            futures = {pool.submit(self._one, p, params): i for i, p in enumerate(prompts)}
            for done, future in enumerate(as_completed(futures), start=1):
                out[futures[future]] = future.result()
                if on_finished is not None:
                    on_finished(done)
        return out  # type: ignore[return-value] - every slot is filled above


def api_key(env_name: str | None) -> str | None:
    if env_name is None:
        return None
    key = os.environ.get(env_name)
    if not key:
        raise EndpointError(f"regenerate.api_key_env={env_name!r}: the environment variable {env_name} is not set or "
                            "empty; export it with the server's API key, or unset regenerate.api_key_env")
    return key


def _served_model(engine: EndpointEngine, target_model: str, model_dir: str, max_model_len: int) -> str:
    cards = engine.call("GET", "/v1/models", timeout_s=CHECK_TIMEOUT_S).get("data", [])
    names = {target_model, model_dir, Path(model_dir).name, Path(target_model).name}
    matching = [c for c in cards if {c.get("id"), c.get("root"), Path(str(c.get("root"))).name} & names]
    if not matching:
        served = ", ".join(f"{c.get('id')} (root {c.get('root')})" for c in cards) or "none"
        raise EndpointError(f"regenerate.endpoint={engine.url} serves {served}; expected the target {target_model} "
                            f"({model_dir}): point regenerate.endpoint at a server of this target, or serve it with "
                            f"--served-model-name {Path(model_dir).name}")
    card = matching[0]
    if card.get("max_model_len") is not None and int(card["max_model_len"]) < max_model_len:
        raise EndpointError(f"regenerate.endpoint={engine.url}: model {card['id']} has max_model_len "
                            f"{card['max_model_len']} < target.max_model_len={max_model_len}; lower target.max_model_len "
                            "or serve with a larger --max-model-len")
    return str(card["id"])


def _check_tokenizer(engine: EndpointEngine, tokenizer, template_ids: Callable[[list[dict]], list[int]]) -> None:  # noqa: ANN001
    probe = [{"role": "user", "content": PROBE_TEXT}]
    ours = {"text": list(tokenizer.encode(PROBE_TEXT, add_special_tokens=False)), "chat template": template_ids(probe)}
    theirs = {
        "text": engine.call("POST", "/tokenize", {"model": engine.model, "prompt": PROBE_TEXT, "add_special_tokens": False},
                            CHECK_TIMEOUT_S).get("tokens"),
        "chat template": engine.call("POST", "/tokenize", {"model": engine.model, "messages": probe, "add_generation_prompt": True,
                                                           "add_special_tokens": False}, CHECK_TIMEOUT_S).get("tokens"),
    }
    for what in ours:
        if ours[what] != theirs[what]:
            raise EndpointError(f"regenerate.endpoint={engine.url}: its tokenizer's {what} ids for a probe differ from the "
                                f"target's ({theirs[what]} against {ours[what]}); expected a server of this very target and "
                                "tokenizer: point regenerate.endpoint at one, or unset it to regenerate in-process")


def open_endpoint(url: str, api_key_env: str | None, *, target_model: str, model_dir: str, max_model_len: int,
                  tokenizer, template_ids: Callable[[list[dict]], list[int]]) -> EndpointEngine:  # noqa: ANN001
    """The endpoint as a TokenGenerator, after checking its model and tokenizer against the target (module docstring)."""
    engine = EndpointEngine(url, model="", api_key=api_key(api_key_env))
    engine.model = _served_model(engine, target_model, model_dir, max_model_len)
    _check_tokenizer(engine, tokenizer, template_ids)
    return engine
