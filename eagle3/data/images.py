"""Images in conversations: OpenAI-style content parts, checked and content-hashed before any model load.

A message's content is a string, or a list of content parts as OpenAI's chat API takes them:
`{"type": "text", "text": str}` and `{"type": "image_url", "image_url": {"url": URL}}`, URL being
`file://<path>` (absolute, or relative to the working directory) or `data:image/<fmt>;base64,<bytes>`.

`check_images` is the one gate: every part of every message must be of a supported type, every image
must be readable and decode as an image, and the target must read images at all (a multimodal target:
its config.json has a `vision_config` and the folder holds the processor's preprocessor_config.json;
a text-only target refuses images). It raises one DataError naming the sample id and the part, and it
returns the images' sha256 (of the bytes, so a changed image changes the fingerprints of the stages that
read it even when its path is the same). Data without content parts never reaches it, so text-only data
keeps its fingerprints.

The placeholder: a multimodal chat template renders each image as one placeholder token (Kimi-K2.5's
`<|media_pad|>`, the config's `media_placeholder_token_id`/`image_token_id`), which vLLM's processor
expands to one position per image token. The loss is never taken at those positions (the draft cannot
predict an image), see conversations.tokenize_turns.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

SUPPORTED_PARTS = ("text", "image_url")
DATA_PREFIX = "data:image/"
FILE_PREFIX = "file://"
# config.json keys that name the image placeholder token, most specific first (Kimi-K2.5, Qwen-VL, Llava/Gemma)
PLACEHOLDER_KEYS = ("media_placeholder_token_id", "image_token_id", "image_token_index")
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


class ImageError(ValueError):
    """A content part cannot be used; the message names the sample id and the part (a DataError subclass wraps it)."""


@dataclass(frozen=True)
class Part:
    """One content part: `type` as given ("text", "image_url", or an unsupported one check_images refuses)."""

    type: str
    text: str = ""  # type "text"
    url: str = ""  # type "image_url"

    def as_dict(self) -> dict[str, object]:
        """The part as OpenAI's API (and the chat templates that take lists) write it."""
        if self.type == "text":
            return {"type": "text", "text": self.text}
        if self.type == "image_url":
            return {"type": "image_url", "image_url": {"url": self.url}}
        return {"type": self.type}


def parse_parts(raw: list) -> tuple[Part, ...] | str:
    """A message's list content -> its parts, or why the list is not content parts (a bad row)."""
    parts = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            return f"content part {i} is not an object with a string 'type'"
        kind = item["type"]
        if kind == "text" and not isinstance(item.get("text"), str):
            return f"content part {i} (text) has no string 'text'"
        url = item.get("image_url", {}).get("url") if isinstance(item.get("image_url"), dict) else None
        if kind == "image_url" and not isinstance(url, str):
            return f"content part {i} (image_url) has no 'image_url': {{'url': str}}"
        parts.append(Part(kind, text=item.get("text", "") if kind == "text" else "", url=url or ""))
    return tuple(parts)


def text_of(content: str | Sequence[Part]) -> str:
    """The text of a content (its text parts joined): what the empty-answer check reads."""
    return content if isinstance(content, str) else "".join(p.text for p in content)


def image_bytes(url: str) -> bytes:
    """The bytes of an image URL (ImageError saying why not)."""
    if url.startswith(DATA_PREFIX):
        head, sep, payload = url.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ImageError(f"data URL {url[:40]!r}... is not data:image/<fmt>;base64,<data>")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as err:
            raise ImageError(f"data URL {head!r}: not valid base64 ({err})") from err
    if url.startswith(FILE_PREFIX):
        path = Path(url.removeprefix(FILE_PREFIX))
        if not path.is_file():
            raise ImageError(f"image file {str(path)!r} does not exist")
        return path.read_bytes()
    raise ImageError(f"image URL {url[:60]!r}: expected file://<path> or data:image/<fmt>;base64,... (no network)")


def load_image(url: str):  # noqa: ANN201 - a PIL image, RGB
    """The image of a URL, decoded (ImageError when it is not an image)."""
    from PIL import Image, UnidentifiedImageError

    data = image_bytes(url)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError) as err:
        raise ImageError(f"image {url[:60]!r} does not decode as an image ({err})") from err
    return image.convert("RGB")


def reads_images(model_dir: str | Path) -> bool:
    """Whether the target takes images: a `vision_config` in its config.json and a processor file beside it."""
    folder = Path(model_dir)
    config = json.loads((folder / "config.json").read_text())
    return "vision_config" in config and any((folder / name).is_file() for name in PROCESSOR_FILES)


def placeholder_id(model_dir: str | Path) -> int | None:
    """The token id a chat template renders an image as (None: the target names none, it reads no images)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return next((int(config[k]) for k in PLACEHOLDER_KEYS if isinstance(config.get(k), int)), None)


def check_images(conversations: Iterable[object], model_dir: str | Path) -> dict[str, str]:
    """{image URL: sha256 of its bytes} of every image in `conversations` (eagle3.data.conversations.Conversation),
    after checking every content part (module docstring); ImageError naming the sample id and the part."""
    hashes: dict[str, str] = {}
    vision: bool | None = None
    for conv in conversations:
        for m, message in enumerate(conv.messages):
            if isinstance(message.content, str):
                continue
            for p, part in enumerate(message.content):
                where = f"sample {conv.id!r}, message {m} ({message.role}), content part {p}"
                if part.type not in SUPPORTED_PARTS:
                    raise ImageError(f"{where}: type {part.type!r} is not supported; expected one of "
                                     f"{list(SUPPORTED_PARTS)} (OpenAI-style content parts)")
                if part.type != "image_url":
                    continue
                if vision is None:
                    vision = reads_images(model_dir)
                if not vision:
                    raise ImageError(f"{where}: an image, but the target {model_dir} is text-only (its config.json has "
                                     "no vision_config, or it has no preprocessor_config.json); remove the image "
                                     "or use a multimodal target")
                if part.url not in hashes:
                    try:
                        load_image(part.url)
                    except ImageError as err:
                        raise ImageError(f"{where}: {err}") from err
                    hashes[part.url] = hashlib.sha256(image_bytes(part.url)).hexdigest()
    return hashes


def image_urls(messages: Sequence[object]) -> list[str]:
    """The image URLs of `messages`, in the order the chat template renders them."""
    return [p.url for m in messages if not isinstance(m.content, str) for p in m.content if p.type == "image_url"]
