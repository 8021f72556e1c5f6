"""Conversations in, token ids + assistant-only loss masks out.

Sources:
- `builtin:chatterbot`: the English conversations of the `chatterbot-corpus` package
  (BSD-3), read from the installed package at run time; each conversation becomes
  user/assistant turns.
- a path to a JSONL file: one conversation per line, `{"id": str, "messages":
  [{"role": "system"|"user"|"assistant", "content": str}, ...], "source": str}` ("source"
  optional).
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

Preparation applies the tokenizer's chat template, marks the tokens of assistant turns
(content and end-of-turn token, not the role header) as the ones to learn, truncates to
`max_tokens`, drops samples with no assistant token left, and splits off a held-out set
by a hash of the sample id (so the split does not move when samples are added).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

log = logging.getLogger(__name__)
Role = Literal["system", "user", "assistant"]
BUILTIN_CHATTERBOT = "builtin:chatterbot"
UNLABELLED = "(no source)"  # evaluate's group of the samples without a source, when others have one


class DataError(ValueError):
    """The dataset cannot be used; the message names the file/line and the setting."""


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str | list[str] = Field(
        default=BUILTIN_CHATTERBOT,
        description="Conversations: 'builtin:chatterbot' (installed chatterbot-corpus package) or a JSONL file path, "
        "or a list of them: each sample's data source is then its row's 'source' field, else the file's name (stem); "
        "evaluate and the nightly gate report acceptance per source",
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
    content: str


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
    if any(not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str)
           for m in row["messages"]):
        return "a message is not {'role': str, 'content': str}"
    bad = sorted({m["role"] for m in row["messages"]} - {"system", "user", "assistant"})
    if bad:
        return f"unknown role(s) {bad}; expected system, user or assistant"
    empty = [i for i, m in enumerate(row["messages"]) if m["role"] == "assistant" and not m["content"].strip()]
    if empty:
        return f"assistant turn(s) {empty} (message index) empty or whitespace only"
    source = row.get("source")
    if source is not None and (not isinstance(source, str) or not source.strip()):
        return f"'source' is {source!r}; expected a non-empty string naming the row's data source, or no 'source' key"
    cid = str(row.get("id", f"line-{line_no}"))
    if cid in seen:
        return f"duplicate id {cid!r} (first on line {seen[cid]})"
    seen[cid] = line_no
    return Conversation(cid, tuple(Message(m["role"], m["content"]) for m in row["messages"]),
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
            row = {"id": conv.id, "messages": [{"role": m.role, "content": m.content} for m in conv.messages]}
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


def _template_ids(tokenizer, messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:  # noqa: ANN001
    chat = [{"role": m.role, "content": m.content} for m in messages]
    out = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def tokenize_conversation(tokenizer, conv: Conversation, max_tokens: int) -> TokenizedSample:  # noqa: ANN001
    """Token ids of the whole conversation and a mask that is 1 on assistant tokens only."""
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(conv.messages):
        if message.role == "assistant":
            # the role header belongs to the prompt: measure it with add_generation_prompt
            header = _template_ids(tokenizer, conv.messages[:i], add_generation_prompt=True)
            mask.extend([0] * (len(header) - len(ids)))
            ids = header
        full = _template_ids(tokenizer, conv.messages[: i + 1], add_generation_prompt=False)
        if full[: len(ids)] != ids:
            raise DataError(f"sample {conv.id!r}: the chat template is not prefix-stable; cannot build a loss mask")
        mask.extend([1 if message.role == "assistant" else 0] * (len(full) - len(ids)))
        ids = full
        if len(ids) >= max_tokens:  # later turns only append (prefix-stable): they would be cut off anyway
            break
    return TokenizedSample(conv.id, ids[:max_tokens], mask[:max_tokens], conv.source)


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
    return row if sample.source is None else row | {"source": sample.source}


def read_samples(path: Path) -> list[TokenizedSample]:
    with open(path, encoding="utf-8") as handle:
        rows = (r for r in map(json.loads, handle) if r)
        return [TokenizedSample(r["id"], r["input_ids"], r["loss_mask"], r.get("source")) for r in rows]
