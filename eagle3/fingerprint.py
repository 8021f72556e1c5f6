"""Content fingerprints: the names of artifacts and the keys of the cache.

A stage's fingerprint is a hash of (stage name, stage version, its own settings, the
fingerprints of its inputs). Bump a stage's version string when its output format or
meaning changes; editing code or comments alone does not change any fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel

FINGERPRINT_CHARS = 20


def _canonical(value: object) -> object:
    if isinstance(value, BaseModel):
        return _canonical(value.model_dump(mode="json"))
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def fingerprint(stage: str, version: str, settings: object, *upstream: str) -> str:
    """Hash of a stage's identity, settings and upstream fingerprints (hex, 20 chars)."""
    payload = json.dumps(
        {"stage": stage, "version": version, "settings": _canonical(settings), "upstream": list(upstream)},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:FINGERPRINT_CHARS]


def hash_files(paths: Iterable[Path]) -> str:
    """sha256 over the names and contents of files (sorted by name)."""
    digest = hashlib.sha256()
    for path in sorted(Path(p) for p in paths):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:FINGERPRINT_CHARS]


def hash_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_CHARS]
