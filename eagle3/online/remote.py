"""Online training data from a capture worker in another process, on this machine or another (online.producer: remote).

The buffer folder (online.buffer_dir, a local or shared folder that both sides see) is the only link; no socket, no
scheduler, no wire format of our own:

- the trainer (`RemoteFeed`) writes `samples.jsonl` (the train split's samples, in store order, as it trains them),
  `feed.json` (what a worker needs: seed, micro-batch size, the samples the hybrid store keeps, the aux ids, hidden
  size, storage dtype, the buffer's bound) and `cursor.json`, the trainer's recorded cursor: the (epoch, cursor) its
  stream started from, a stream id, and which micro-batches of the stream it has consumed;
- a worker (`run_capture_worker`; `eagle3 online-capture --buffer DIR --model DIR`) walks the same micro-batch
  sequence (eagle3.draft.batches.next_batch_indices from that (epoch, cursor)), captures each micro-batch's samples
  through its own engine and writes them as `batch-<stream>-<k>.safetensors` (the store's shard format, written under
  a temporary name and renamed), only when the bytes of the shards in the folder plus this one fit online.buffer_gib;
- the trainer reads shard k when it is there (waiting up to online.remote_wait_s, then one clear error), deletes it,
  and records it in cursor.json.

The shard index is the handshake. A restarted worker starts at the first micro-batch the trainer has not consumed
(cursor.json), skipping shards already on disk; a restarted trainer starts a new stream from its checkpoint's cursor
(a new stream id), and the worker drops the old stream's shards. The trainer removes every file of the feed at the end;
a worker that finds feed.json gone stops.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from eagle3.artifacts import atomic_write_text, remove_write_temporaries
from eagle3.capture.store import shard_header
from eagle3.draft.batches import next_batch_indices
from eagle3.online.feed import (
    Capture,
    OnlineData,
    OnlineDataError,
    OnlineSample,
    kept_locations,
    remove_shards,
    shard_bytes,
    write_shard,
)

log = logging.getLogger(__name__)
FEED_FILE, CURSOR_FILE, SAMPLES_FILE = "feed.json", "cursor.json", "samples.jsonl"
FEED_FILES = (FEED_FILE, CURSOR_FILE, SAMPLES_FILE)
POLL_S = 0.02


def shard_name(stream: str, k: int) -> str:
    return f"batch-{stream}-{k:08d}.safetensors"


def buffer_bytes_on_disk(folder: Path) -> int:
    """What the bound counts: the bytes of every shard (and shard being written) in the folder."""
    try:
        paths = [*folder.glob("batch-*.safetensors"), *folder.glob(".batch-*.safetensors.tmp-*")]
    except FileNotFoundError:  # the folder removed while listed (the feed closed): nothing on disk
        return 0
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):  # deleted between listing and stat
            total += path.stat().st_size
    return total


def clear_buffer(folder: Path) -> None:
    """What a feed leaves in its buffer folder, local or remote, removed: feed.json first (a worker then stops), the
    shards, the cursor and samples, a killed writer's temporaries; then the folder if that left it empty (a folder
    of the user's keeps its other files), and the default's online_buffer/ when no other run's buffer is in it."""
    (folder / FEED_FILE).unlink(missing_ok=True)
    remove_shards(folder)
    for name in (CURSOR_FILE, SAMPLES_FILE):
        (folder / name).unlink(missing_ok=True)
    remove_write_temporaries(folder, FEED_FILES)
    with contextlib.suppress(OSError):
        folder.rmdir()
        if folder.parent.name == "online_buffer":
            folder.parent.rmdir()


class RemoteFeed:
    """The trainer's side: OnlineFeed's interface (locations, consumed, close, stats) over shards a worker writes."""

    def __init__(self, data: OnlineData, lengths: Sequence[int], seed: int, batch_tokens: int, epoch: int,
                 cursor: int) -> None:
        self.data, self.folder, self.batch_tokens = data, Path(data.buffer_dir), batch_tokens
        self.folder.mkdir(parents=True, exist_ok=True)
        self.kept_locations = kept_locations(data)
        self.stream = secrets.token_hex(4)
        remove_shards(self.folder)  # an earlier stream's: this one starts at the checkpoint's cursor
        remove_write_temporaries(self.folder, FEED_FILES)  # a killed trainer's half-written cursor (SIGKILL in fsync)
        self.done: set[int] = set()
        self.lock = threading.Lock()
        self.closed = False
        self.start = {"stream": self.stream, "epoch": epoch, "cursor": cursor}
        self.tokens_captured, self.peak_bytes = 0, 0
        samples = "".join(json.dumps([s.input_ids, s.loss_mask]) + "\n" for s in data.samples)
        atomic_write_text(self.folder / SAMPLES_FILE, samples)
        atomic_write_text(self.folder / FEED_FILE, json.dumps({
            "seed": seed, "batch_tokens": batch_tokens, "kept": data.kept, "aux_layer_ids": list(data.aux_layer_ids),
            "hidden_size": data.hidden_size, "storage_dtype": str(data.storage_dtype).removeprefix("torch."),
            "buffer_bytes": data.buffer_bytes, "num_samples": len(data.samples)}))
        self._write_cursor()

    def _write_cursor(self) -> None:
        consumed = 0
        while consumed in self.done:
            consumed += 1
        later = sorted(k for k in self.done if k > consumed)
        atomic_write_text(self.folder / CURSOR_FILE, json.dumps(self.start | {"consumed": consumed, "also": later}))

    def locations(self, k: int, indices: Sequence[int]) -> dict[int, tuple[str, int]]:
        need = [i for i in indices if i >= self.data.kept]
        found: dict[int, tuple[str, int]] = {}
        if need:
            path = self.folder / shard_name(self.stream, k)
            deadline = time.monotonic() + self.data.remote_wait_s
            while not path.exists():
                if self.closed:
                    raise OnlineDataError("online data feed closed")
                if time.monotonic() > deadline:
                    raise OnlineDataError(
                        f"micro-batch {k} ({path.name}) did not reach the buffer {self.folder} within "
                        f"online.remote_wait_s={self.data.remote_wait_s:g} s (online.producer='remote'): start a capture "
                        f"worker on it (`eagle3 online-capture --buffer {self.folder} --model <target folder>`), or "
                        "raise online.remote_wait_s, or set online.producer='local'")
                time.sleep(POLL_S)
            on_disk = buffer_bytes_on_disk(self.folder)
            ids = json.loads(shard_header(str(path))[1]["__metadata__"]["sample_ids"])
            found = {int(i): (str(path), j) for j, i in enumerate(ids)}
            with self.lock:  # the loader threads read side by side
                self.peak_bytes = max(self.peak_bytes, on_disk)
                self.tokens_captured += sum(min(self.data.samples[i].tokens, self.batch_tokens) for i in need)
        missing = [i for i in indices if i not in found and i not in self.kept_locations]
        if missing:
            raise OnlineDataError(f"micro-batch {k}: samples {missing[:10]} are not in {self.folder / shard_name(self.stream, k)} "
                                  "(a worker of another feed writes into this buffer folder? give each run its own "
                                  "online.buffer_dir)")
        return {i: found.get(i) or self.kept_locations[i] for i in indices}

    def consumed(self, k: int) -> None:
        (self.folder / shard_name(self.stream, k)).unlink(missing_ok=True)
        with self.lock:
            if self.closed:  # a loader thread that read ahead of the last step: writing the cursor now would leave
                return  # cursor.json (and the folder) behind after close
            self.done.add(k)
            self._write_cursor()

    def close(self) -> None:
        """Nothing of the feed outlives the run (clear_buffer)."""
        with self.lock:  # no cursor write after this (consumed)
            self.closed = True
            clear_buffer(self.folder)

    def stats(self) -> dict[str, float]:
        return {"tokens_captured": self.tokens_captured, "capture_seconds": 0.0, "buffer_peak_bytes": self.peak_bytes}


# -- the worker ---------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not there (yet, or any more), or replaced while read
        return None


def run_capture_worker(folder: Path, capture: Capture, wait_s: float = 600.0,
                       say: Callable[[str], None] = log.info) -> int:
    """Capture for the trainer whose feed is in `folder` until it finishes (feed.json gone); returns the shards written.

    Waits up to `wait_s` for the trainer's feed.json to appear."""
    folder = Path(folder)
    deadline = time.monotonic() + wait_s
    while (feed := _read_json(folder / FEED_FILE)) is None or _read_json(folder / CURSOR_FILE) is None:
        if time.monotonic() > deadline:
            raise OnlineDataError(f"no trainer's feed in {folder} after {wait_s:g} s ({FEED_FILE} and {CURSOR_FILE}); "
                                  "start the train stage with online.producer='remote' and online.buffer_dir set to "
                                  "this folder first, or pass the folder it prints (--buffer)")
        time.sleep(0.1)
    samples = [OnlineSample(ids, mask) for ids, mask in
               (json.loads(line) for line in (folder / SAMPLES_FILE).read_text().splitlines())]
    for tmp in folder.glob(".batch-*.safetensors.tmp-*"):  # a killed worker's half shard (one worker per buffer)
        tmp.unlink(missing_ok=True)
    say(f"online-capture: {len(samples)} samples, buffer {folder} (at most {feed['buffer_bytes']:,} bytes)")
    written = 0
    while (_read_json(folder / FEED_FILE)) is not None:
        cursor = _read_json(folder / CURSOR_FILE)
        if cursor is None:
            time.sleep(POLL_S)
            continue
        written += _serve_stream(folder, feed, samples, cursor, capture)
    with contextlib.suppress(OSError):  # a shard that landed after the trainer cleaned up: nothing outlives the run
        remove_shards(folder)
        folder.rmdir()
    say(f"online-capture: the trainer finished; {written} shards written")
    return written


def _serve_stream(folder: Path, feed: dict, samples: list[OnlineSample], start: dict, capture: Capture) -> int:
    """Shards of the stream `start` names, from the first micro-batch its trainer has not consumed, until the stream
    changes (the trainer restarted) or the feed ends."""
    stream, lengths, tokens = start["stream"], [len(s.input_ids) for s in samples], int(feed["batch_tokens"])
    epoch, cursor, k, written = int(start["epoch"]), int(start["cursor"]), 0, 0
    consumed, also = 0, set()
    dtype = getattr(torch, feed["storage_dtype"])
    n_states = len(feed["aux_layer_ids"]) + 1
    with contextlib.suppress(FileNotFoundError):  # the folder removed while listed: the feed closed, _changed says so
        for path in list(folder.glob("batch-*.safetensors")):  # an earlier stream's: its trainer will never read them
            if not path.name.startswith(f"batch-{stream}-"):
                path.unlink(missing_ok=True)
    while True:
        now = _read_json(folder / CURSOR_FILE)  # the trainer's progress: never capture what it has consumed
        if now is not None and now.get("stream") == stream:
            consumed, also = int(now["consumed"]), set(now.get("also", []))
        if _changed(folder, stream):
            return written
        indices, epoch, cursor = next_batch_indices(lengths, int(feed["seed"]), epoch, cursor, tokens)
        need = [i for i in indices if i >= int(feed["kept"])]
        final = folder / shard_name(stream, k)
        if need and k >= consumed and k not in also and not final.exists():
            size = shard_bytes(sum(min(lengths[i], tokens) for i in need), len(need), n_states, feed["hidden_size"],
                               dtype)
            while buffer_bytes_on_disk(folder) and buffer_bytes_on_disk(folder) + size > int(feed["buffer_bytes"]):
                if _changed(folder, stream):
                    return written
                time.sleep(POLL_S)
            if _changed(folder, stream):
                return written
            prompts = [samples[i].input_ids[:tokens] for i in need]
            states = capture(prompts)  # per prompt [T_i, n_aux+1, H]
            try:
                write_shard(final, need, prompts, [samples[i].loss_mask for i in need], states, n_states,
                            int(feed["hidden_size"]), dtype)
            except OSError:
                if _changed(folder, stream):  # the trainer finished (or restarted) and removed the feed meanwhile
                    return written
                raise
            written += 1
        k += 1


def _changed(folder: Path, stream: str) -> bool:
    """The trainer restarted (another stream) or finished (no feed.json)."""
    cursor = _read_json(folder / CURSOR_FILE)
    return not (folder / FEED_FILE).exists() or (cursor is not None and cursor.get("stream") != stream)
