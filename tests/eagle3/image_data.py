"""Test fixtures for conversations with images (issue 28, item 3): a tiny Kimi-K2.5 whose chat template renders
image parts as Kimi-K2.5's own template does, random small PNGs, and JSONL rows that use them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.eagle3 import arch_builders

# Kimi-K2.5's chat template renders an image part as <|media_begin|>image<|media_content|><|media_pad|><|media_end|>;
# the tiny target's template (arch_builders.KIMI_TEMPLATE) takes string content only.
KIMI_IMAGE_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image_url' %}<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


def build_kimi_with_images(out: Path) -> Path:
    """The tiny Kimi-K2.5 (vision tower included) with a chat template that renders image parts."""
    arch_builders.build_kimi_k25(out)
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = KIMI_IMAGE_TEMPLATE
    config_file.write_text(json.dumps(config, indent=1))
    return out


def write_png(path: Path, seed: int, size: tuple[int, int] = (56, 84)) -> Path:
    """A random RGB PNG of `size` (height, width); 56 x 84 is 2 x 3 merged 14-pixel patches: 6 image tokens."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8")
    Image.fromarray(pixels).save(path, format="PNG")
    return path


def image_row(cid: str, image: Path | str, question: str = "What is in the picture?", answer: str = "A cat.") -> dict:
    """A one-turn conversation whose user turn holds an image (a path: a file:// URL; a str: the URL itself)."""
    url = f"file://{image}" if isinstance(image, Path) else image
    return {"id": cid, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]},
        {"role": "assistant", "content": answer}]}


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
