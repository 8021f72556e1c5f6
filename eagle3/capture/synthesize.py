"""The synthesize stage: the target writes its own user prompts (`data.source: synthesize`).

Magpie (Xu et al., 2024): an instruct model given only its chat template's user-turn prefix (the
rendered template up to where the user's text would start, e.g. ChatML's `<|im_start|>user\\n`)
writes what a user would ask, and stops at the end of the user turn. The prefix is found by
rendering a conversation whose user text is a sentinel and cutting at the sentinel; the end of the
turn is the first special token the template writes after it (ChatML's `<|im_end|>`), and the
tokenizer's eos. A template in which the sentinel never appears has no user turn: refused, naming
data.source and the target. `synthesize.system_prompts` steer the prompts: request j's prefix
opens with a system turn holding system_prompts[j % len] (round-robin), and its conversation keeps
that system turn, so the target's answer is written under it too.

Each request j samples with its own seed (from synthesize.seed and j), so that identical prefixes
give different prompts and a rerun asks the same requests the same way. vLLM takes a seed per
request: an engine in this process or a warm engine process (`generate_seeded`) takes a whole
call's requests at once; an endpoint (one seed per call) takes each request in a call of its own. A prompt is dropped when
it is empty, a duplicate of a kept one (the same normalised text: lower case, punctuation and
runs of white space folded to one space) or a near-duplicate (word 3-gram Jaccard similarity with
a kept one at or above synthesize.similarity). Dropped ones are asked for again, round after
round, until synthesize.prompts are kept or synthesize.max_rounds x synthesize.prompts requests
were made in all; then the stage says how many it kept. A prompt cut at max_prompt_tokens (no end
of turn) is kept, and counted.

Resume: each request's prompt is appended to a journal (`prompts.jsonl` in the stage's folder,
one {"request", "system", "text", "kept", "why", "cut"} row each) as soon as its engine call
returns; a rerun replays the journal through the same filter and asks only for what is missing,
from the next request number (and loads no engine when nothing is).

The conversations (one user turn each, id `s<request>`, data source `synthesized`) go to the
regenerate stage as a JSONL file, each with a placeholder assistant turn that regenerate replaces
by the target's answer (regenerate needs an assistant turn to answer; the placeholder is never
learned: data.source synthesize needs regenerate.enabled).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, field_validator

from eagle3.capture import vllm_adapter
from eagle3.capture.regenerate import TokenGenerator
from eagle3.data.conversations import Conversation, DataError, Message, template_text

log = logging.getLogger(__name__)
JOURNAL = "prompts.jsonl"
SOURCE = "synthesized"  # the data source of every synthesized conversation
PLACEHOLDER = "(written by the target in the regenerate stage)"  # the assistant turn regenerate replaces
SENTINEL = "EAGLE3SYNTHESIZEDUSERTEXT"  # a user text no template rewrites, cut out to find the user-turn prefix
# In-process vLLM: requests per engine call; the journal is written after each call, so a killed run loses at
# most one call's prompts, while one call still keeps the engine's batch full.
REQUESTS_PER_CALL = 1024
Progress = Callable[[int, int, int | None], None]  # (prompts kept, prompts wanted, tokens generated so far)


class SynthesizeError(DataError):
    """The target cannot write prompts (its chat template has no user turn); the message names the setting."""


class SynthesizeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prompts: int = Field(
        default=256, ge=1, description="data.source=synthesize: how many distinct user prompts the target writes (each "
        "becomes one conversation that regenerate answers; data.max_samples is not used then)",
    )
    temperature: float = Field(
        default=1.0, gt=0.0, description="Sampling temperature of the prompts (above 0: greedy decoding would write one "
        "prompt over and over)",
    )
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass of the prompts")
    max_prompt_tokens: int = Field(
        default=128, ge=1, description="Longest prompt the target writes; one that reaches it without ending its user "
        "turn is kept as cut there (counted as `cut` in the stage's stats)",
    )
    seed: int = Field(default=0, description="Sampling seed; each request samples with its own seed derived from it")
    system_prompts: list[str] = Field(
        default_factory=list, description="Steer the prompts: request j's user-turn prefix opens with a system turn "
        "holding system_prompts[j % len] (round-robin), e.g. 'You help people with questions about cooking.'; the "
        "conversation keeps it, so the answer is written under it too. Empty: the template's own default",
    )
    similarity: float = Field(
        default=0.8, gt=0.0, le=1.0, description="Drop a prompt whose word 3-gram Jaccard similarity with a kept one "
        "is at least this (exact duplicates, after folding case, punctuation and white space, are always dropped)",
    )
    max_rounds: int = Field(
        default=4, ge=1, description="Ask again for the prompts still missing after dropping empty and duplicate ones, "
        "up to max_rounds x prompts requests in all; then the stage keeps what it has and says how many",
    )

    @field_validator("system_prompts")
    @classmethod
    def _systems(cls, value: list[str]) -> list[str]:
        blank = [i for i, s in enumerate(value) if not s.strip()]
        if blank:
            raise ValueError(f"entry {blank[0]} is empty; expected the text of a system turn, or no entry")
        return value


# -- the template's user turn ---------------------------------------------------------------
@dataclass(frozen=True)
class UserTurn:
    """Where a user's text goes in the target's template: the prefix ids per system prompt, and the end of turn."""

    prefixes: tuple[tuple[int, ...], ...]  # per system prompt (one when there is none), the ids before the user text
    stop_ids: tuple[int, ...]  # the end of the user turn: the template's first special token after it, and eos


def user_turn(tokenizer, systems: Sequence[str], template_kwargs: Mapping[str, object] | None,  # noqa: ANN001
              model_dir: str) -> UserTurn:
    """The user-turn prefixes of the target's chat template (module docstring); SynthesizeError when the template
    renders no user turn, or cannot render one."""
    prefixes, after = [], ""
    for system in systems or [None]:
        messages = ([Message("system", system)] if system is not None else []) + [Message("user", SENTINEL)]
        try:
            text = template_text(tokenizer, messages, False, template_kwargs)
        except Exception as err:  # noqa: BLE001 - no template, or a template that refuses this conversation
            raise SynthesizeError(f"data.source='synthesize': the chat template of the target {model_dir} cannot render "
                                  f"a user turn ({type(err).__name__}: {err}); use a target with a chat template, or "
                                  "set data.source to a file of conversations") from None
        at = text.find(SENTINEL)
        if at < 0:
            raise SynthesizeError(f"data.source='synthesize': the chat template of the target {model_dir} has no user "
                                  "turn (a user message's text never appears in what it renders), so there is no "
                                  "user-turn prefix to write prompts from; use a target whose chat template has a "
                                  "user turn, or set data.source to a file of conversations")
        prefixes.append(tuple(tokenizer.encode(text[:at], add_special_tokens=False)))
        after = text[at + len(SENTINEL):]
    special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    end = next((t for t in tokenizer.encode(after, add_special_tokens=False) if t in special), None)
    stops = {t for t in (end, tokenizer.eos_token_id) if t is not None}
    return UserTurn(tuple(prefixes), tuple(sorted(stops)))


# -- dropping empty and duplicate prompts ---------------------------------------------------
def normalise(text: str) -> str:
    """Lower case, punctuation dropped, runs of white space folded to one space."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def shingles(normalised: str) -> frozenset[tuple[str, ...]]:
    """The word 3-grams of a normalised text (a text of fewer than 3 words: its words, as one shingle)."""
    words = normalised.split()
    if len(words) < 3:
        return frozenset({tuple(words)})
    return frozenset(tuple(words[i:i + 3]) for i in range(len(words) - 2))


@dataclass
class Deduper:
    """Keeps a prompt unless it is empty, a duplicate or a near-duplicate of one kept before (module docstring)."""

    similarity: float
    _texts: set[str] = field(default_factory=set)
    _kept: list[frozenset[tuple[str, ...]]] = field(default_factory=list)
    _index: dict[tuple[str, ...], list[int]] = field(default_factory=dict)  # shingle -> kept prompts holding it

    def why_dropped(self, text: str) -> str | None:
        """None (and the prompt is kept), or why it is dropped: 'empty', 'duplicate' or 'near-duplicate'."""
        norm = normalise(text)
        if not norm:
            return "empty"
        if norm in self._texts:
            return "duplicate"
        mine = shingles(norm)
        for other in {i for s in mine for i in self._index.get(s, ())}:
            theirs = self._kept[other]
            if len(mine & theirs) / len(mine | theirs) >= self.similarity:
                return "near-duplicate"
        self._texts.add(norm)
        for s in mine:
            self._index.setdefault(s, []).append(len(self._kept))
        self._kept.append(mine)
        return None


# -- the stage's work -----------------------------------------------------------------------
@dataclass(frozen=True)
class Written:
    """A request's prompt, as the journal holds it."""

    request: int
    system: int | None  # index in synthesize.system_prompts; None: none
    text: str
    why: str | None  # why it was dropped; None: kept
    cut: bool  # reached max_prompt_tokens without ending its user turn


@dataclass(frozen=True)
class SynthesizeResult:
    kept: list[Written]
    requests: int  # requests made in all, this run and the runs before it (journal)
    reused: int  # requests taken from the journal of an earlier run
    generated_tokens: int  # tokens generated in this run
    dropped: dict[str, int]  # reason -> prompts dropped


def request_seed(seed: int, request: int) -> int:
    """Request `request`'s own sampling seed."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{request}".encode()).digest()[:4], "big") & 0x7FFFFFFF


def synthesize(tokenizer, get_engine: Callable[[], object], config: SynthesizeConfig, turn: UserTurn,  # noqa: ANN001
               journal: Path, progress: Progress | None = None) -> SynthesizeResult:
    """Up to config.prompts distinct prompts written by the target (module docstring); `journal`: resumed from and
    appended to; `get_engine` is called only when a prompt is missing."""
    dedupe = Deduper(config.similarity)
    kept: list[Written] = []
    dropped: dict[str, int] = {}
    done = read_journal(journal)
    for row in done:
        why = dedupe.why_dropped(row.text)  # replayed: the same filter, in the same order, keeps the same prompts
        _tally(row, why, kept, dropped)
    next_request, generated, engine = len(done), 0, None
    budget = config.max_rounds * config.prompts
    while len(kept) < config.prompts and next_request < budget:
        asked = list(range(next_request, min(next_request + config.prompts - len(kept), budget)))
        for start in range(0, len(asked), REQUESTS_PER_CALL):
            chunk = asked[start:start + REQUESTS_PER_CALL]
            engine = get_engine() if engine is None else engine
            systems = [j % len(config.system_prompts) if config.system_prompts else None for j in chunk]
            outputs = sample(engine, [list(turn.prefixes[s or 0]) for s in systems],
                             [request_seed(config.seed, j) for j in chunk], config, turn.stop_ids)
            rows = []
            for j, system, ids in zip(chunk, systems, outputs):
                generated += len(ids)
                body = _until_stop(ids, turn.stop_ids)
                text = tokenizer.decode(body, skip_special_tokens=True).strip()
                cut = len(body) == len(ids) >= config.max_prompt_tokens  # no end of turn: stopped by the length
                rows.append(Written(j, system, text, dedupe.why_dropped(text), cut))
            append_journal(journal, rows)
            for row in rows:
                _tally(row, row.why, kept, dropped)
            if progress is not None:
                progress(len(kept), config.prompts, generated)
        next_request = asked[-1] + 1
    return SynthesizeResult(kept[:config.prompts], next_request, len(done), generated, dropped)


def _tally(row: Written, why: str | None, kept: list[Written], dropped: dict[str, int]) -> None:
    """Add `row` to `kept` (why None), or count it under `why` in `dropped`."""
    if why is None:
        kept.append(row)
    else:
        dropped[why] = dropped.get(why, 0) + 1


def _until_stop(ids: Sequence[int], stops: Sequence[int]) -> list[int]:
    """The prompt's ids before its end of turn (all of them when it has none: cut at max_prompt_tokens)."""
    at = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    return list(ids[:at])


@runtime_checkable
class SeededGenerator(Protocol):
    """An engine elsewhere that samples each prompt with its own seed in one call (a warm engine process)."""

    def generate_seeded(self, prompts: Sequence[Sequence[int]], *, seeds: Sequence[int], max_new_tokens: int,
                        temperature: float, top_p: float, stop_ids: Sequence[int],
                        on_finished: Callable[[int], None] | None = None) -> list[list[int]]:
        ...


def sample(engine, prompts: Sequence[Sequence[int]], seeds: Sequence[int], config: SynthesizeConfig,  # noqa: ANN001
           stop_ids: Sequence[int]) -> list[list[int]]:
    """The engine's continuation of each prompt, each request sampled with its own seed, stopping at the end of the
    user turn. An in-process vllm.LLM or a warm engine process takes them in one call; an endpoint (a TokenGenerator:
    one seed per call) takes them one call each."""
    sampling = {"max_new_tokens": config.max_prompt_tokens, "temperature": config.temperature, "top_p": config.top_p}
    if isinstance(engine, SeededGenerator):
        return engine.generate_seeded(prompts, seeds=seeds, stop_ids=stop_ids, **sampling)
    if isinstance(engine, TokenGenerator):
        return [list(engine.generate_ids([p], seed=s, **sampling)[0]) for p, s in zip(prompts, seeds)]
    return sample_seeded(engine, prompts, seeds=seeds, stop_ids=stop_ids, **sampling)


def sample_seeded(llm, prompts: Sequence[Sequence[int]], *, seeds: Sequence[int], max_new_tokens: int,  # noqa: ANN001
                  temperature: float, top_p: float, stop_ids: Sequence[int],
                  on_finished: Callable[[int], None] | None = None) -> list[list[int]]:
    """vllm.LLM generation from token-id prompts, each sampled with its own seed, stopping at `stop_ids`; the
    generated ids in prompt order (where the warm engine process runs a SeededGenerator's call, too)."""
    return vllm_adapter.generate_seeded(llm, prompts, seeds=seeds, max_new_tokens=max_new_tokens,
                                        temperature=temperature, top_p=top_p, stop_ids=stop_ids, on_finished=on_finished)


# -- journal and output ---------------------------------------------------------------------
def read_journal(path: Path) -> list[Written]:
    """The journal's whole rows, in request order up to the first gap (a row cut by a kill is dropped, and asked
    for again)."""
    if not path.is_file():
        return []
    raw = path.read_bytes()
    if not raw.endswith(b"\n"):  # cut by a kill mid-row: drop the piece, so that new rows start on a line of their own
        with open(path, "r+b") as handle:
            handle.truncate(raw.rfind(b"\n") + 1)
    rows: dict[int, Written] = {}
    for line in raw.decode("utf-8", errors="replace").splitlines():
        try:
            r = json.loads(line)
            rows[int(r["request"])] = Written(int(r["request"]), r["system"], str(r["text"]), r["why"], bool(r["cut"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    out = []
    while len(out) in rows:
        out.append(rows[len(out)])
    return out


def append_journal(path: Path, rows: Sequence[Written]) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps({"request": row.request, "system": row.system, "text": row.text, "kept": row.why is None,
                                     "why": row.why, "cut": row.cut}, ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def conversations_of(kept: Sequence[Written], systems: Sequence[str]) -> list[Conversation]:
    """regenerate's input: per kept prompt its system turn (if any), the prompt and the placeholder answer."""
    out = []
    for row in kept:
        head = (Message("system", systems[row.system]),) if row.system is not None else ()
        out.append(Conversation(f"s{row.request:06d}", head + (Message("user", row.text), Message("assistant", PLACEHOLDER)),
                                SOURCE))
    return out
