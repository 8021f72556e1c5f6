"""Conversations in, token ids + assistant-only loss masks out.

Sources:
- `builtin:chatterbot`: the English conversations of the `chatterbot-corpus` package
  (BSD-3), read from the installed package at run time; each conversation becomes
  user/assistant turns.
- a path to a JSONL file: one conversation per line, `{"id": str, "messages":
  [{"role": "system"|"user"|"assistant", "content": str | [part, ...]}, ...], "source": str}` ("source"
  optional; an assistant message may carry `"reasoning_content": str`, its reasoning, as vLLM's
  OpenAI server returns it and as chat templates read it; a content given as a list holds
  OpenAI-style content parts, text and images: eagle3.data.images, whose `check_images` refuses an
  unsupported part, a missing image or an image for a text-only target before any model load).
- a list of those: the files (and builtin names) read in the order listed.

Each sample may carry a *data source*, the kind of request it stands for, which evaluate
groups its figures by: the row's "source" field, else, when `data.source` lists several
entries or any row of the file names a source, the entry's name (a file's stem, `chatterbot`
for the builtin). With several entries, sample ids are prefixed with the entry's name
(`name:id`), so that two files may reuse an id. When no source is given anywhere, samples carry
none, and every artifact is what it was before sources existed.

A JSONL row that cannot be used (not valid UTF-8, not JSON, not that shape, an unknown role,
an empty or whitespace-only assistant turn, an id seen on an earlier line, a "source" that is
not a non-empty string) is skipped and
recorded as a BadRow with its line number, up to `data.max_bad_rows` of them (per file); one more
fails the load with a DataError naming the setting. The prepare_data stage writes the per-line
report (`bad_rows.jsonl`) into its artifact and counts the rows in its stats.

Preparation applies the tokenizer's chat template (with regenerate.chat_template_kwargs), marks
the tokens of assistant turns (reasoning, content and end-of-turn token, not the role header) as
the ones to learn, truncates to `max_tokens`, drops samples with no assistant token left, and
splits off a held-out set by a hash of the conversation id (so the split does not move when
samples are added).

A conversation is one sample when the template renders it prefix-stably (each turn's tokens
start with the tokens of the turns before it). A template that renders the history of a later
turn differently (Qwen3's and Kimi-K2.5's drop the reasoning of earlier turns) gives one sample
per such turn instead (`tokenize_turns`): the sample of turn k is the conversation up to turn k
rendered as the server renders it when it serves turn k, and learns turn k's tokens only.

Message content is turned into the template's message dicts in one place (`chat_messages`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from eagle3.data.images import ImageError, Part, check_images, image_urls, parse_parts, text_of

log = logging.getLogger(__name__)
Role = Literal["system", "user", "assistant"]
BUILTIN_CHATTERBOT = "builtin:chatterbot"
SYNTHESIZE = "synthesize"  # data.source: the target writes the prompts (eagle3.capture.synthesize, docs/synthesize.md)
UNLABELLED = "(no source)"  # evaluate's group of the samples without a source, when others have one


class DataError(ValueError):
    """The dataset cannot be used; the message names the file/line and the setting."""


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str | list[str] = Field(
        default=BUILTIN_CHATTERBOT,
        description="Conversations: 'builtin:chatterbot' (installed chatterbot-corpus package) or a JSONL file path, "
        "or a list of them: each sample's data source is then its row's 'source' field, else the file's name (stem); "
        "evaluate and the nightly gate report acceptance per source; or 'synthesize': the target writes its own "
        "prompts (the synthesize settings, docs/synthesize.md)",
    )
    max_samples: int = Field(default=256, ge=1, description="Use at most this many conversations (in source order; "
                             "with a list, across every entry, read in the order listed)")
    max_tokens: int = Field(default=512, ge=8, description="Truncate each tokenized conversation to this many tokens")
    heldout_fraction: float = Field(default=0.1, ge=0.0, lt=1.0, description="Share of samples held out for evaluation")
    split_seed: int = Field(default=0, description="Seed of the hash that assigns samples to the held-out set")
    # 100: a logged or scraped dataset often has a few broken lines, which should not cost a run;
    # a file in the wrong format or schema makes every line bad and fails at line 101, at once.
    max_bad_rows: int = Field(
        default=100, ge=0,
        description="Unusable JSONL rows (bad JSON/UTF-8/shape, unknown role, empty assistant turn, duplicate id) "
        "skipped and listed with their line numbers before the stage fails; 0 = refuse any bad row",
    )

    @field_validator("source")
    @classmethod
    def _source(cls, value: str | list[str]) -> str | list[str]:
        entries = value if isinstance(value, list) else [value]
        if not entries:
            raise ValueError(f"data.source=[]: expected a JSONL file path or {BUILTIN_CHATTERBOT!r}, or a non-empty "
                             "list of them")
        blank = [i for i, e in enumerate(entries) if not e.strip()]
        if blank:
            which = f"entry {blank[0]} is empty" if isinstance(value, list) else "empty"
            raise ValueError(f"data.source={value!r}: {which}; expected a JSONL file path or {BUILTIN_CHATTERBOT!r}")
        if SYNTHESIZE in entries and len(entries) > 1:
            raise ValueError(f"data.source={value!r}: {SYNTHESIZE!r} cannot be listed with other entries; expected "
                             f"data.source={SYNTHESIZE!r} alone, or a list of files")
        names: dict[str, str] = {}
        for entry in entries:
            name = source_name(entry)
            if name in names:
                raise ValueError(f"data.source={value!r}: {names[name]!r} and {entry!r} both give the source name "
                                 f"{name!r} (a file's name without its folder and suffix); list each file once, and "
                                 "rename one of two files that share a name")
            names[name] = entry
        return value


@dataclass(frozen=True)
class BadRow:
    """A skipped source row: 1-based line number, why, and the data.source entry it is in ("": the only one)."""

    line: int
    reason: str
    file: str = ""


@dataclass(frozen=True)
class Message:
    role: Role
    content: str | tuple[Part, ...]  # a string, or content parts (text and images: eagle3.data.images)
    reasoning: str | None = None  # an assistant turn's reasoning ("reasoning_content"); None: none given


def chat_messages(messages: Sequence[Message]) -> list[dict[str, object]]:
    """Messages as the chat template (and our JSONL rows) take them: {"role", "content"} and, where an assistant
    turn has reasoning, "reasoning_content" (the key vLLM's server returns and Qwen3's and Kimi's templates read).
    A content of parts stays a list of OpenAI-style part dicts (multimodal templates render an image part as its
    placeholder token)."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else [p.as_dict() for p in m.content]
        row = {"role": m.role, "content": content}
        out.append(row if m.reasoning is None else row | {"reasoning_content": m.reasoning})
    return out


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[Message, ...]
    source: str | None = None  # its data source (module docstring); None: none given


# -- loading -----------------------------------------------------------------------------
def chatterbot_dir() -> Path:
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data.source=builtin:chatterbot needs the 'chatterbot-corpus' package (pip install chatterbot-corpus)")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "english"


def source_entries(source: str | list[str]) -> list[str]:
    """data.source as a list of entries (a string is a list of one)."""
    return list(source) if isinstance(source, list) else [source]


def source_name(entry: str) -> str:
    """The data source a data.source entry names: a file's stem, or the builtin's name ('chatterbot')."""
    return entry.removeprefix("builtin:") if entry.startswith("builtin:") else Path(entry).stem


def source_files(source: str | list[str]) -> list[Path]:
    """The files a source reads (their contents are its fingerprint); DataError naming the first listed file that
    does not exist, before any is read."""
    files: list[Path] = []
    for entry in source_entries(source):
        if entry == BUILTIN_CHATTERBOT:
            files += sorted(chatterbot_dir().glob("*.yml"))
            continue
        if entry == SYNTHESIZE:  # the train-eagle3 flow replaces it by the synthesize stage's file
            raise DataError(f"data.source={SYNTHESIZE!r}: the prompts are written by the synthesize stage of an "
                            "`eagle3 run`; here set data.source to a file of conversations")
        path = Path(entry)
        if not path.is_file():
            where = f"data.source={entry!r}" if isinstance(source, str) else f"data.source entry {entry!r} (of {source!r})"
            raise DataError(f"{where}: no such file; expected a JSONL file or {BUILTIN_CHATTERBOT!r}")
        files.append(path)
    return files


def names_sources(source: str | list[str]) -> bool:
    """Whether the samples of `source` may carry data sources: several entries, or a file with a 'source' key.

    Cheap and may say yes wrongly (a message object with a "source" key); never says no wrongly. Stages add a
    marker to their fingerprints when it is true, so data without sources keeps the fingerprints of before."""
    entries = source_entries(source)
    if len(entries) > 1:
        return True
    return any(b'"source"' in path.read_bytes() for path in source_files(source) if path.suffix != ".yml")


def has_parts(source: str | list[str]) -> bool:
    """Whether a message of `source` may hold content parts (a list content; its parts carry a "type" key).

    Cheap and may say yes wrongly; never says no wrongly. Stages check and hash images only when it is true, so
    text-only data keeps its fingerprints (and costs no extra read)."""
    return any(b'"type"' in path.read_bytes() for path in source_files(source) if path.suffix != ".yml")


def check_content(conversations: Sequence[Conversation], model_dir: str | Path) -> dict[str, str]:
    """{image URL: sha256} of the images in `conversations` after checking every content part against the target
    (eagle3.data.images.check_images); DataError naming the sample id and the part."""
    try:
        return check_images(conversations, model_dir)
    except ImageError as err:
        raise DataError(str(err)) from err


def _load_chatterbot(limit: int) -> list[Conversation]:
    out: list[Conversation] = []
    for path in source_files(BUILTIN_CHATTERBOT):
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for i, turns in enumerate(doc.get("conversations") or []):
            texts = [str(t).strip() for t in turns if str(t).strip()]
            if len(texts) < 2:
                continue
            roles: list[Role] = ["user" if j % 2 == 0 else "assistant" for j in range(len(texts))]
            out.append(Conversation(f"{path.stem}-{i:04d}", tuple(Message(r, t) for r, t in zip(roles, texts))))
            if len(out) >= limit:
                return out
    return out


def _parse_row(raw: bytes, line_no: int, seen: dict[str, int]) -> Conversation | str:
    """One JSONL line -> a Conversation, or the reason it cannot be used."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"not valid UTF-8 ({err.reason} at byte {err.start})"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        return f"not JSON ({err.msg} at column {err.colno})"
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
        return "not a conversation; expected {'id', 'messages': [{'role', 'content'}, ...]}"
    if any(not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), (str, list))
           or not isinstance(m.get("reasoning_content", ""), str) for m in row["messages"]):
        return ("a message is not {'role': str, 'content': str or a list of content parts} (with an optional "
                "'reasoning_content': str)")
    contents = [m["content"] if isinstance(m["content"], str) else parse_parts(m["content"]) for m in row["messages"]]
    shape = next((f"message {i}: {c}" for i, c in enumerate(contents)
                  if isinstance(c, str) and isinstance(row["messages"][i]["content"], list)), None)
    if shape:
        return shape
    bad = sorted({m["role"] for m in row["messages"]} - {"system", "user", "assistant"})
    if bad:
        return f"unknown role(s) {bad}; expected system, user or assistant"
    empty = [i for i, m in enumerate(row["messages"])
             if m["role"] == "assistant" and not text_of(contents[i]).strip() and not m.get("reasoning_content", "").strip()]
    if empty:
        return f"assistant turn(s) {empty} (message index) empty or whitespace only"
    source = row.get("source")
    if source is not None and (not isinstance(source, str) or not source.strip()):
        return f"'source' is {source!r}; expected a non-empty string naming the row's data source, or no 'source' key"
    cid = str(row.get("id", f"line-{line_no}"))
    if cid in seen:
        return f"duplicate id {cid!r} (first on line {seen[cid]})"
    seen[cid] = line_no
    return Conversation(cid, tuple(Message(m["role"], c, m.get("reasoning_content")) for m, c in zip(row["messages"], contents)),
                        None if source is None else source.strip())


def scan_jsonl(path: Path, limit: int, max_bad_rows: int) -> tuple[list[Conversation], list[BadRow]]:
    """Up to `limit` usable conversations and the rows skipped on the way (stops once over `max_bad_rows`)."""
    out: list[Conversation] = []
    bad: list[BadRow] = []
    seen: dict[str, int] = {}
    with open(path, "rb") as handle:  # bytes: one line of invalid UTF-8 must not fail the whole file
        for line_no, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            parsed = _parse_row(raw, line_no, seen)
            if isinstance(parsed, str):
                bad.append(BadRow(line_no, parsed))
                if len(bad) > max_bad_rows:
                    break
                continue
            out.append(parsed)
            if len(out) >= limit:
                break
    return out, bad


def _too_many_bad(path: Path, bad: Sequence[BadRow], max_bad_rows: int) -> DataError:
    first = "; ".join(f"{path}:{b.line}: {b.reason}" for b in bad[:5])
    return DataError(
        f"data.source={str(path)!r}: more than data.max_bad_rows={max_bad_rows} unusable rows ({first}"
        f"{' ...' if len(bad) > 5 else ''}); fix the file or raise data.max_bad_rows"
    )


def _load_entry(entry: str, limit: int, max_bad_rows: int) -> tuple[list[Conversation], list[BadRow]]:
    """The usable conversations of one data.source entry and the rows skipped (DataError when over budget or none usable)."""
    if entry == BUILTIN_CHATTERBOT:
        return _load_chatterbot(limit), []
    path = source_files(entry)[0]
    conversations, bad = scan_jsonl(path, limit, max_bad_rows)
    if len(bad) > max_bad_rows:
        raise _too_many_bad(path, bad, max_bad_rows)
    if not conversations:
        why = f"all {len(bad)} rows were unusable (first: line {bad[0].line}: {bad[0].reason})" if bad else "it holds no row"
        raise DataError(f"data.source={entry!r}: no usable conversation: {why}; expected one conversation per line")
    for b in bad:
        log.warning("%s:%d: skipped: %s", path, b.line, b.reason)
    return conversations, [BadRow(b.line, b.reason, entry) for b in bad]


def load_source(config: DataConfig) -> tuple[list[Conversation], list[BadRow]]:
    """The usable conversations of `config.source` (every entry, in order, data.max_samples in all) with their data
    sources (module docstring), and the rows skipped. DataError when an entry is missing (before any is read), over
    its bad-row budget, gives no usable conversation, or is not reached because data.max_samples ran out before it."""
    entries = source_entries(config.source)
    source_files(config.source)  # every listed file exists, or the error names it before anything is read
    several = len(entries) > 1
    out: list[Conversation] = []
    bad: list[BadRow] = []
    for entry in entries:
        left = config.max_samples - len(out)
        if left <= 0:
            raise DataError(f"data.source entry {entry!r} is never read: data.max_samples={config.max_samples} "
                            f"conversations came from the entries listed before it; raise data.max_samples or put "
                            "the entries you need first")
        conversations, skipped = _load_entry(entry, left, config.max_bad_rows)
        bad += skipped
        if several or any(c.source is not None for c in conversations):  # then every sample names a source
            name = source_name(entry)
            conversations = [Conversation(f"{name}:{c.id}" if several else c.id, c.messages, c.source or name)
                             for c in conversations]
        out += conversations
    return out, bad


def load_conversations(config: DataConfig) -> list[Conversation]:
    return load_source(config)[0]


def write_bad_rows(path: Path, source: str, bad: Sequence[BadRow]) -> None:
    """The per-line report of skipped rows: one JSON object a line, {"source", "line", "reason"} ("source": the
    data.source entry the row is in)."""
    with open(path, "w", encoding="utf-8") as handle:
        for b in bad:
            handle.write(json.dumps({"source": b.file or source, "line": b.line, "reason": b.reason}) + "\n")


def write_conversations(path: Path, conversations: Sequence[Conversation]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for conv in conversations:
            row = {"id": conv.id, "messages": chat_messages(conv.messages)}
            if conv.source is not None:
                row["source"] = conv.source
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


# -- tokenization ------------------------------------------------------------------------
@dataclass(frozen=True)
class TokenizedSample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens
    source: str | None = None  # its data source; None: none given
    images: tuple[str, ...] = ()  # the image URLs of its messages, in the order their placeholders appear


def _template_ids(tokenizer, messages: Sequence[Message], add_generation_prompt: bool,  # noqa: ANN001
                  template_kwargs: Mapping[str, object] | None = None) -> list[int]:
    """The chat template's token ids for `messages` (`template_kwargs`: regenerate.chat_template_kwargs)."""
    out = tokenizer.apply_chat_template(chat_messages(messages), tokenize=True, add_generation_prompt=add_generation_prompt,
                                        **dict(template_kwargs or {}))
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def template_text(tokenizer, messages: Sequence[Message], add_generation_prompt: bool,  # noqa: ANN001
                  template_kwargs: Mapping[str, object] | None = None) -> str:
    """The chat template's text for `messages` (what _template_ids tokenizes)."""
    return tokenizer.apply_chat_template(chat_messages(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **dict(template_kwargs or {}))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_turns(tokenizer, conv: Conversation, max_tokens: int,  # noqa: ANN001
                   template_kwargs: Mapping[str, object] | None = None, placeholder: int | None = None) -> list[TokenizedSample]:
    """The samples of a conversation (module docstring): one when the template is prefix-stable, else a new one
    from each turn whose history the template renders differently, each cut to `max_tokens`. The first keeps the
    conversation's id, a later one is `<id>#<k>` (k: the assistant turn, 1-based, it starts learning at).
    `placeholder`: the target's image placeholder token id (eagle3.data.images), never learned; a sample keeps the
    URLs of the images whose placeholders it holds."""
    segments: list[tuple[int, list[int], list[int]]] = []  # (first turn it learns, ids, mask)
    ids: list[int] = []
    mask: list[int] = []
    first, turn = 1, 0
    for i, message in enumerate(conv.messages):
        if message.role == "assistant":
            turn += 1
            # the role header belongs to the prompt: it is the history as the server renders it for this turn
            header = _template_ids(tokenizer, conv.messages[:i], True, template_kwargs)
            if header[: len(ids)] != ids:  # the history reads differently now (earlier reasoning dropped): new sample
                segments.append((first, ids, mask))
                ids, mask, first = [], [], turn
            mask, ids = mask + [0] * (len(header) - len(ids)), header
        full = _template_ids(tokenizer, conv.messages[: i + 1], False, template_kwargs)
        if message.role == "assistant":
            # learned from the first token that differs from the header: where a tokenizer merges the answer's first
            # characters with the header's last ones, that merged token is the first the target produced
            keep = _common_prefix(ids, full)
            ids, mask = full, mask[:keep] + [1] * (len(full) - keep)
            continue
        if full[: len(ids)] != ids:
            segments.append((first, ids, mask))
            ids, mask, first = [], [], turn + 1
        mask, ids = mask + [0] * (len(full) - len(ids)), full
    segments.append((first, ids, mask))
    kept = [(f, i, m) for f, i, m in segments if i]
    urls = image_urls(conv.messages)
    if urls:
        _check_placeholders(conv.id, kept[-1][1], urls, placeholder)
        # an image position is never learned (the draft cannot predict an image)
        kept = [(f, i, [0 if t == placeholder else x for t, x in zip(i, m)]) for f, i, m in kept]
    return [TokenizedSample(conv.id if n == 0 else f"{conv.id}#{f}", i[:max_tokens], m[:max_tokens], conv.source,
                            tuple(urls[:i[:max_tokens].count(placeholder)]) if urls else ())
            for n, (f, i, m) in enumerate(kept)]


def _check_placeholders(cid: str, ids: Sequence[int], urls: Sequence[str], placeholder: int | None) -> None:
    """The whole conversation's ids `ids` hold one `placeholder` per image (DataError otherwise: an image the template
    does not render, or a target that names no placeholder, would be dropped silently). Each sample renders its
    conversation from the start, and a cut to data.max_tokens drops the last tokens, so a sample holds the first
    images, one per placeholder it holds."""
    if placeholder is None:
        raise DataError(f"sample {cid!r} holds images, but the target's config.json names no image placeholder token "
                        "(media_placeholder_token_id, image_token_id or image_token_index); use a multimodal target")
    count = list(ids).count(placeholder)
    if count != len(urls):
        raise DataError(f"sample {cid!r}: the chat template rendered {count} image placeholder tokens (id "
                        f"{placeholder}) for its {len(urls)} image_url parts; expected one per image (does the "
                        "target's chat template render image parts?)")


def tokenize_conversation(tokenizer, conv: Conversation, max_tokens: int,  # noqa: ANN001
                          template_kwargs: Mapping[str, object] | None = None) -> TokenizedSample:
    """Token ids of the whole conversation and a mask that is 1 on assistant tokens only (one sample: DataError when
    the template renders a later turn's history differently, see tokenize_turns)."""
    samples = tokenize_turns(tokenizer, conv, max_tokens, template_kwargs)
    if len(samples) != 1:
        raise DataError(f"sample {conv.id!r}: the chat template renders later turns' history differently; it gives "
                        f"{len(samples)} samples (tokenize_turns), not one")
    return samples[0]


def is_heldout(sample_id: str, fraction: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def write_samples(path: Path, samples: Sequence[TokenizedSample]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for s in samples:
            handle.write(json.dumps(sample_row(s)) + "\n")


def sample_row(sample: TokenizedSample) -> dict[str, object]:
    """A prepared sample as its JSONL row; "source" only when it has one (data without sources is as before)."""
    row: dict[str, object] = {"id": sample.id, "input_ids": sample.input_ids, "loss_mask": sample.loss_mask}
    if sample.images:
        row["images"] = list(sample.images)
    return row if sample.source is None else row | {"source": sample.source}


def read_samples(path: Path) -> list[TokenizedSample]:
    with open(path, encoding="utf-8") as handle:
        rows = (r for r in map(json.loads, handle) if r)
        return [TokenizedSample(r["id"], r["input_ids"], r["loss_mask"], r.get("source"), tuple(r.get("images", ())))
                for r in rows]
