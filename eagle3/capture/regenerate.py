"""The regenerate stage: the target answers the prompts, so the draft learns its own target.

Turn by turn, as the server sees a conversation: the target writes assistant turn 1 from the turns
before it; turn 2's prompt is then the history with the TARGET's turn-1 answer and the dataset's
next user turn; and so on, up to `regenerate.max_turns` assistant turns (greedy when temperature is
0, sampled otherwise). A conversation ends early where a turn's prompt plus max_new_tokens does not
fit target.max_model_len (skipped altogether when that is turn 1). The conversation keeps its id and
its data source (eagle3.data.conversations), so evaluate can still group the samples by source.

Prompts are the chat template's token ids with `regenerate.chat_template_kwargs` (a reasoning switch:
Qwen3's `enable_thinking`, Kimi-K2.5's `thinking`). A generated answer that holds reasoning
(`<think>` ... `</think>`, or everything up to `</think>` when the template's generation prompt opened
the block) keeps it as the turn's `reasoning_content`, apart from its content, as vLLM's reasoning
parsers return it: the chat template then renders it, or drops it from later turns' history, as it
does for the server. A truncated reasoning (no `</think>` within max_new_tokens) is all reasoning.
A template that never reads `reasoning_content` would lose it, so there the answer stays one text,
as before.

Per-turn resume: every answer is appended to a journal (`turns.jsonl` in the stage's folder, one
{"id", "turn", "prompt", "answer"} row each, `prompt` a hash of the prompt's token ids) as soon as
its engine call returns; a rerun takes an answer from it when the conversation, turn and prompt
match, so a run killed between turns regenerates only the turns that are missing (and loads no
engine when none is).

Images (eagle3.data.images): a prompt whose messages hold image parts goes to the engine with its images
(`multi_modal_data`, vLLM's multimodal processing for the target, the vision tower loaded: the stages load the
engine with language_model_only=False when the data holds images). An engine in this process or a warm engine
process on this host (an ImageGenerator: it is sent the image URLs and loads them itself) takes them; an
endpoint is refused with the way out named.

Progress moves as answers finish: vLLM's `LLM.generate` reports each finished request to the
tqdm class it is given (`use_tqdm`), and ours passes the count on (vllm_adapter._counting_bar).
So each turn's prompts go to the engine all in one call (`requests_per_call` None), where its
scheduler keeps the batch full to the end; smaller calls would drain the batch at each call's tail.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from eagle3.capture import vllm_adapter
from eagle3.data.conversations import Conversation, DataError, Message, _template_ids, template_text
from eagle3.data.images import image_urls

Progress = Callable[[int, int, int | None], None]  # (requests answered, requests in all, tokens generated so far or None)
TemplateValue = bool | int | float | str | None
# apply_chat_template's own arguments: a chat_template_kwargs key with one of these names is refused.
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})
THINK_START, THINK_END = "<think>", "</think>"  # the reasoning block of Qwen3, DeepSeek-R1, Kimi-K2/K2.5
JOURNAL = "turns.jsonl"


class RegenerateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(default=True, description="Let the target write the answers (off: train on the dataset's own answers)")
    max_new_tokens: int = Field(
        default=128, ge=1, description="Longest answer the target writes per turn, reasoning included; must be below "
        "target.max_model_len (a turn whose prompt plus this does not fit ends its conversation there)",
    )
    temperature: float = Field(default=0.0, ge=0.0, description="Sampling temperature; 0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (ignored when greedy)")
    seed: int = Field(default=0, description="Sampling seed")
    max_turns: int = Field(
        default=1, ge=1, description="Assistant turns regenerated per conversation, turn by turn: turn k's prompt "
        "holds the target's own answers to turns 1..k-1 (the dataset's later turns are dropped)",
    )
    chat_template_kwargs: dict[str, TemplateValue] = Field(
        default_factory=dict, description="Extra variables for the target's chat template, in regenerate and "
        "prepare_data (also with enabled=false), e.g. {enable_thinking: true} (Qwen3) or {thinking: true} "
        "(Kimi-K2.5); each must be a variable the template reads",
    )
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

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value: dict[str, TemplateValue]) -> dict[str, TemplateValue]:
        taken = sorted(set(value) & TEMPLATE_ARGUMENTS)
        if taken:
            raise ValueError(f"keys {taken} are arguments the pipeline gives apply_chat_template itself, not template "
                             "variables; remove them (expected variables such as enable_thinking or thinking)")
        return value

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


@runtime_checkable
class ImageGenerator(Protocol):
    """A TokenGenerator that also takes prompts with images: per prompt its image URLs (a warm engine on this host)."""

    def generate_with_images(self, prompts: Sequence[Sequence[int]], *, images: Sequence[Sequence[str]],
                             max_new_tokens: int, temperature: float, top_p: float, seed: int,
                             on_finished: Callable[[int], None] | None = None) -> list[list[int]]:
        ...


@dataclass(frozen=True)
class RegenerateResult:
    conversations: list[Conversation]
    skipped_too_long: int
    generated_tokens: int
    reused_turns: int = 0  # answers taken from the journal of an earlier, interrupted run


@dataclass
class _Dialog:
    """A conversation being regenerated: the turns so far (the target's answers) and where the dataset resumes."""

    conv: Conversation
    history: tuple[Message, ...] = ()
    next_message: int = 0  # index in conv.messages of the first message not yet in history
    turns: int = 0  # assistant turns answered


@dataclass
class _Ask:
    dialog: _Dialog
    head: tuple[Message, ...]  # the prompt's messages
    ids: list[int]  # the prompt's token ids
    answer_at: int  # index in conv.messages of the assistant turn being answered
    opened: bool  # the generation prompt opened a reasoning block
    answer: list[int] = field(default_factory=list)


def regenerate(
    conversations: Sequence[Conversation],
    tokenizer,  # noqa: ANN001 - a transformers tokenizer with a chat template
    get_engine: Callable[[], object],
    config: RegenerateConfig,
    max_model_len: int,
    progress: Progress | None = None,
    requests_per_call: int | None = None,
    journal: Path | None = None,
) -> RegenerateResult:
    """The target's answers to each conversation, turn by turn (module docstring); `journal`: the per-turn journal
    to resume from and append to (None: none)."""
    dialogs = [_Dialog(c) for c in conversations]
    done = _read_journal(journal)
    engine = _Lazy(get_engine)
    skipped, generated, reused, answered = 0, 0, 0, 0
    planned = sum(min(config.max_turns, sum(m.role == "assistant" for m in c.messages)) for c in conversations)
    for turn in range(1, config.max_turns + 1):
        asks = []
        for dialog in (d for d in dialogs if d.turns == turn - 1):  # the ones that answered every turn so far
            ask = _next_ask(dialog, tokenizer, config, max_model_len)
            if ask is not None:
                asks.append(ask)
                continue
            skipped += turn == 1 and any(m.role == "assistant" for m in dialog.conv.messages)
            planned -= _remaining(dialog, config.max_turns)
        if not asks:
            break
        todo = [ask for ask in asks if not _from_journal(ask, done.get((ask.dialog.conv.id, turn)))]
        reused += len(asks) - len(todo)
        answered += len(asks) - len(todo)
        if todo:
            outputs = _generate_all(engine, todo, config, turn, journal, progress, requests_per_call,
                                    (answered, planned, generated))
            generated += sum(len(t) for t in outputs)
            answered += len(todo)
        for ask in asks:
            _take_answer(ask, tokenizer)
    out = [Conversation(d.conv.id, d.history, d.conv.source) for d in dialogs if d.turns]
    return RegenerateResult(out, skipped, generated, reused)


class _Lazy:
    """The engine, asked for on first use (a rerun whose turns are all in the journal loads none)."""

    def __init__(self, get: Callable[[], object]) -> None:
        self._get, self._engine = get, None

    def __call__(self) -> object:
        if self._engine is None:
            self._engine = self._get()
        return self._engine


def _from_journal(ask: _Ask, row: tuple[str, list[int]] | None) -> bool:
    """Take the answer from the journal `row` (prompt hash, answer ids) when it answered this very prompt."""
    if row is None or row[0] != _prompt_hash(ask.ids):
        return False
    ask.answer = row[1]
    return True


def _remaining(dialog: _Dialog, max_turns: int) -> int:
    """The planned turns a conversation that stops now will not take."""
    later = sum(m.role == "assistant" for m in dialog.conv.messages[dialog.next_message:])
    return min(later, max_turns - dialog.turns)


def _next_ask(dialog: _Dialog, tokenizer, config: RegenerateConfig, max_model_len: int) -> _Ask | None:  # noqa: ANN001
    """The prompt of the dialog's next assistant turn, or None where it ends (no further assistant turn, no user
    turn before it, or a prompt that with max_new_tokens does not fit max_model_len)."""
    messages = dialog.conv.messages
    at = next((i for i in range(dialog.next_message, len(messages)) if messages[i].role == "assistant"), None)
    if at is None or not any(m.role == "user" for m in messages[dialog.next_message:at]):
        return None
    head = dialog.history + messages[dialog.next_message:at]
    kwargs = config.chat_template_kwargs
    ids = _template_ids(tokenizer, head, True, kwargs)
    if len(ids) + config.max_new_tokens > max_model_len:
        return None
    header = template_text(tokenizer, head, True, kwargs).removeprefix(template_text(tokenizer, head, False, kwargs))
    return _Ask(dialog, head, ids, at, opened=header.rfind(THINK_START) > header.rfind(THINK_END))


def _take_answer(ask: _Ask, tokenizer) -> None:  # noqa: ANN001
    if reads_reasoning(tokenizer):
        reasoning, content = split_reasoning(decode_answer(tokenizer, ask.answer), ask.opened)
    else:  # a template that never reads reasoning_content would lose it: the answer stays one text, as generated
        reasoning, content = None, decode_answer(tokenizer, ask.answer).strip()
    dialog = ask.dialog
    dialog.history = ask.head + (Message("assistant", content, reasoning),)
    dialog.next_message = ask.answer_at + 1
    dialog.turns += 1


def reads_reasoning(tokenizer) -> bool:  # noqa: ANN001
    """Whether the tokenizer's chat template reads an assistant turn's `reasoning_content` (Qwen3's, Kimi's do)."""
    template = tokenizer.chat_template
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any("reasoning_content" in text for text in texts)


def decode_answer(tokenizer, tokens: Sequence[int]) -> str:  # noqa: ANN001
    """The answer's text without special tokens, but with reasoning tags that are special tokens in this tokenizer."""
    tags = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
            if t.content in (THINK_START, THINK_END) and t.special}
    if not tags:
        return tokenizer.decode(list(tokens), skip_special_tokens=True)
    pieces: list[str] = []
    run: list[int] = []
    for token in tokens:
        if token in tags:
            pieces += [tokenizer.decode(run, skip_special_tokens=True), tags[token]]
            run = []
        else:
            run.append(token)
    return "".join(pieces + [tokenizer.decode(run, skip_special_tokens=True)])


def split_reasoning(text: str, opened: bool) -> tuple[str | None, str]:
    """(reasoning, content) of a generated answer; reasoning None when it has no reasoning block. `opened`: the
    generation prompt already opened the block, so the answer starts inside it."""
    body = text.lstrip()
    if not opened and body.startswith(THINK_START):
        body, opened = body[len(THINK_START):], True
    if not opened:
        return None, text.strip()
    reasoning, _, content = body.partition(THINK_END)
    return reasoning.strip(), content.strip()


def _prompt_hash(ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:20]


def _read_journal(path: Path | None) -> dict[tuple[str, int], tuple[str, list[int]]]:
    """(conversation id, turn) -> (prompt hash, answer ids) of the journal's whole rows (a row cut by a kill is
    ignored, and answered again)."""
    out: dict[tuple[str, int], tuple[str, list[int]]] = {}
    if path is None or not path.is_file():
        return out
    text = path.read_bytes()
    if not text.endswith(b"\n"):  # cut by a kill mid-row: drop the piece, so that new rows start on a line of their own
        with open(path, "r+b") as handle:
            handle.truncate(text.rfind(b"\n") + 1)
    for line in text.decode("utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
            out[(row["id"], int(row["turn"]))] = (row["prompt"], [int(t) for t in row["answer"]])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return out


def _append_journal(path: Path | None, turn: int, asks: Sequence[_Ask]) -> None:
    if path is None:
        return
    with open(path, "a", encoding="utf-8") as handle:
        for ask in asks:
            handle.write(json.dumps({"id": ask.dialog.conv.id, "turn": turn, "prompt": _prompt_hash(ask.ids),
                                     "answer": ask.answer}) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _generate_all(engine: Callable[[], object], asks: list[_Ask], config: RegenerateConfig, turn: int,
                  journal: Path | None, progress: Progress | None, requests_per_call: int | None,
                  counts: tuple[int, int, int]) -> list[list[int]]:
    """The engine's answers to `asks` (also set on each), in order, `requests_per_call` at a time, journaled and
    reported after each call; `counts`: (requests answered before these, requests planned, tokens generated before)."""
    before, planned, tokens_before = counts
    step = requests_per_call or len(asks)
    llm = engine()
    images = [image_urls(a.head) for a in asks]
    if any(images) and isinstance(llm, TokenGenerator) and not isinstance(llm, ImageGenerator):
        raise DataError(f"sample {next(a.dialog.conv.id for a, i in zip(asks, images) if i)!r}: its prompt holds images, "
                        f"and regenerate's engine ({type(llm).__name__}) takes token ids only; images are regenerated "
                        "by a vLLM engine of ours (in this process or warm): unset regenerate.endpoint")
    if any(images) and isinstance(llm, ImageGenerator):
        generate = llm.generate_with_images
    elif isinstance(llm, TokenGenerator):
        generate = llm.generate_ids
    else:
        generate = partial(vllm_adapter.generate, llm)
    outputs: list[list[int]] = []
    if progress is not None:
        progress(before, planned, tokens_before)  # the engine is loaded: the rate counts from the first of these
    for start in range(0, len(asks), step):
        chunk = asks[start:start + step]
        finished = None if progress is None else (lambda n, b=before + len(outputs): progress(b + n, planned, None))
        extra = {"images": images[start:start + step]} if any(images) else {}
        answers = generate([a.ids for a in chunk], max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                           top_p=config.top_p, seed=config.seed, on_finished=finished, **extra)
        for ask, answer in zip(chunk, answers):
            ask.answer = list(answer)
        _append_journal(journal, turn, chunk)
        outputs += answers
        if progress is not None:
            progress(before + len(outputs), planned, tokens_before + sum(len(t) for t in outputs))
    return outputs


def template_kwargs_problem(kwargs: Mapping[str, object], template: str | None, model_dir: str) -> str | None:
    """Why regenerate.chat_template_kwargs cannot work with the target's chat template `template` (None: it can):
    no template, or a key the template never reads (a misspelt switch would be silently ignored)."""
    if not kwargs:
        return None
    if template is None:
        return (f"regenerate.chat_template_kwargs={dict(kwargs)!r}: the target {model_dir} has no chat template to "
                "pass them to; remove regenerate.chat_template_kwargs")
    import jinja2
    from jinja2 import meta

    try:
        names = meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return None  # the tokenizer's own error says more, on first use
    unread = sorted(set(kwargs) - names)
    if not unread:
        return None
    others = sorted(names - {"messages", "add_generation_prompt"})
    reads = f"it reads {others}" if others else "it reads no variable besides messages and add_generation_prompt"
    return (f"regenerate.chat_template_kwargs: {unread} not read by the chat template of {model_dir} ({reads}); "
            "check the spelling against the template, or remove the key (a template without the switch ignores it)")
