"""The regenerate stage: the target answers the prompts, so the draft learns its own target.

Each conversation keeps its turns up to (not including) the first assistant turn; the
target writes that assistant turn (greedy when temperature is 0, sampled otherwise). The
conversation keeps its id and its data source (eagle3.data.conversations), so evaluate can
still group the regenerated samples by source.

Progress moves as answers finish: vLLM's `LLM.generate` reports each finished request to the
tqdm class it is given (`use_tqdm`), and ours passes the count on (vllm_adapter._counting_bar).
So the prompts go to the engine all in one call (`requests_per_call` None), where its scheduler
keeps the batch full to the end; smaller calls would drain the batch at each call's tail.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from eagle3.capture import vllm_adapter
from eagle3.data.conversations import Conversation, Message, _template_ids

Progress = Callable[[int, int, int | None], None]  # (requests answered, requests in all, tokens generated so far or None)


class RegenerateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="Let the target write the answers (off: train on the dataset's own answers)")
    max_new_tokens: int = Field(default=128, ge=1, description="Longest answer the target writes")
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (ignored when greedy)")
    seed: int = Field(default=0, description="Sampling seed")
    endpoint: str | None = Field(
        default=None, description="URL of an OpenAI-compatible server of this very target that you already run (e.g. "
        "`vllm serve` at http://127.0.0.1:8000): regenerate sends it the same token-id prompts and sampling instead of "
        "loading the target; its model and tokenizer are checked against the target first (eagle3.engine.endpoint). "
        "None: the target regenerates in-process or in a warm engine",
    )
    api_key_env: str | None = Field(
        default=None, description="Name of the environment variable that holds the endpoint's API key (sent as a bearer "
        "token); None: no key",
    )

    @model_validator(mode="after")
    def _endpoint(self) -> RegenerateConfig:
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"regenerate.endpoint={self.endpoint!r}: expected an http:// or https:// URL of an "
                             "OpenAI-compatible server, e.g. http://127.0.0.1:8000")
        if self.endpoint is not None and not self.enabled:
            raise ValueError("regenerate.endpoint is set but regenerate.enabled=false; unset one of them")
        return self


# Where the answers are computed, not what they are: kept out of every fingerprint.
RUNTIME_REGENERATE_SETTINGS = {"endpoint", "api_key_env"}


@runtime_checkable
class TokenGenerator(Protocol):
    """An engine reached elsewhere (a warm engine process, an OpenAI-compatible server): token ids in, token ids out."""

    def generate_ids(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float, top_p: float,
                     seed: int, on_finished: Callable[[int], None] | None = None) -> list[list[int]]:
        ...


@dataclass(frozen=True)
class RegenerateResult:
    conversations: list[Conversation]
    skipped_too_long: int
    generated_tokens: int


def regenerate(
    conversations: Sequence[Conversation],
    tokenizer,  # noqa: ANN001 - a transformers tokenizer with a chat template
    get_engine: Callable[[], object],
    config: RegenerateConfig,
    max_model_len: int,
    progress: Progress | None = None,
    requests_per_call: int | None = None,
) -> RegenerateResult:
    prompts: list[tuple[Conversation, tuple[Message, ...], list[int]]] = []
    skipped = 0
    for conv in conversations:
        first_answer = next((i for i, m in enumerate(conv.messages) if m.role == "assistant"), len(conv.messages))
        head = conv.messages[:first_answer]
        if not any(m.role == "user" for m in head):
            skipped += 1
            continue
        ids = _template_ids(tokenizer, head, add_generation_prompt=True)
        if len(ids) + config.max_new_tokens > max_model_len:
            skipped += 1
            continue
        prompts.append((conv, head, ids))
    if not prompts:
        return RegenerateResult([], skipped, 0)
    outputs = _generate_all(get_engine(), [ids for _, _, ids in prompts], config, progress, requests_per_call)
    out = []
    for (conv, head, _), tokens in zip(prompts, outputs):
        text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        out.append(Conversation(conv.id, head + (Message("assistant", text),), conv.source))
    return RegenerateResult(out, skipped, sum(len(t) for t in outputs))


def _generate_all(engine: object, prompts: list[list[int]], config: RegenerateConfig, progress: Progress | None,
                  requests_per_call: int | None) -> list[list[int]]:
    """The engine's answers to `prompts`, in order, `requests_per_call` at a time, reporting after each call."""
    step = requests_per_call or len(prompts)
    generate = engine.generate_ids if isinstance(engine, TokenGenerator) else partial(vllm_adapter.generate, engine)
    outputs: list[list[int]] = []
    if progress is not None:
        progress(0, len(prompts), 0)  # the engine is loaded: the rate counts from here
    for start in range(0, len(prompts), step):
        finished = None if progress is None else (lambda n, before=len(outputs): progress(before + n, len(prompts), None))
        outputs += generate(prompts[start:start + step], max_new_tokens=config.max_new_tokens,
                            temperature=config.temperature, top_p=config.top_p, seed=config.seed, on_finished=finished)
        if progress is not None:
            progress(len(outputs), len(prompts), sum(len(t) for t in outputs))
    return outputs
