"""A tiny target whose chat template has a reasoning switch, as Qwen3's and Kimi-K2.5's have: a copy of the tiny
target (same weights and tokenizer) whose template, with `enable_thinking` on, opens `<think>` in the generation
prompt, renders the reasoning (`reasoning_content`) of the turns after the last user turn, and drops the reasoning
of earlier turns from the history."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{- '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['role'] == 'assistant' and thinking and loop.index0 > ns.last_user -%}"
    "{%- set reasoning = message['reasoning_content'] if message['reasoning_content'] is defined "
    "and message['reasoning_content'] is not none else '' -%}"
    "{{- '<think>\n' + reasoning + '\n</think>\n\n' -}}"
    "{%- endif -%}"
    "{{- message['content'] + '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if thinking -%}{{- '<think>\n' -}}{%- endif -%}{%- endif -%}"
)


def build_thinking_target(tiny_target: Path, out: Path) -> Path:
    """`out`: the tiny target with THINKING_TEMPLATE as its chat template (reused when already there)."""
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tiny_target, tmp, ignore=shutil.ignore_patterns(".eagle3-complete*"))
    config = json.loads((tmp / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    tmp.rename(out)
    return out
