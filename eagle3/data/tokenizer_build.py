"""A ChatML byte-level BPE tokenizer trained locally, for the tiny test targets.

Owns: the ChatML chat template (SmolLM2-Instruct's, verbatim), the special tokens, the local
English corpus it is trained on (the chatterbot-corpus package's YAML conversations) and the
training itself. No hub access: everything comes from installed packages.

The special tokens take ids 0, 1, 2 in the same order as SmolLM2's tokenizer:
`<|endoftext|>` (unk), `<|im_start|>` (bos), `<|im_end|>` (eos and pad).
Training with the `tokenizers` library is deterministic: the same corpus and vocab size give
byte-identical tokenizer files (checked across processes).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# SmolLM2-135M-Instruct's chat template, verbatim as its GGUF carries it (the newlines inside the
# Jinja string literals are real newline characters, as in the hub's tokenizer_config.json).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS_PACKAGE = "chatterbot_corpus"
CORPUS_INSTALL = "pip install chatterbot-corpus"


class TokenizerBuildError(RuntimeError):
    """The local corpus is missing or cannot support the tokenizer that was asked for."""


def corpus_files() -> list[Path]:
    """The English YAML files of the installed chatterbot-corpus package, sorted by name."""
    spec = importlib.util.find_spec(CORPUS_PACKAGE)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerBuildError(
            f"package {CORPUS_PACKAGE!r} is not installed; the tiny target's tokenizer is trained "
            f"on its English conversations. Install it with `{CORPUS_INSTALL}`."
        )
    english = Path(list(spec.submodule_search_locations)[0]) / "data" / "english"
    files = sorted(english.glob("*.yml"))
    if not files:
        raise TokenizerBuildError(
            f"no *.yml files under {english}; expected the chatterbot-corpus English "
            f"conversations. Reinstall with `{CORPUS_INSTALL}`."
        )
    return files


def load_conversations(files: list[Path]) -> list[list[str]]:
    """Each conversation as its list of turns, in file order (turns alternate user/assistant)."""
    conversations: list[list[str]] = []
    for path in files:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for turns in data.get("conversations", []):
            # A few YAML scalars parse as numbers or booleans: keep their text.
            conversations.append([str(turn) for turn in turns])
    return conversations


def render_chatml(turns: list[str]) -> str:
    """One conversation as ChatML text, the way the chat template lays it out."""
    roles = ("user", "assistant")
    return "".join(
        f"{IM_START}{roles[i % 2]}\n{turn}{IM_END}\n" for i, turn in enumerate(turns)
    )


def train_chatml_bpe(vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` entries.

    Trained on the corpus rendered as ChatML, so role names and the newline after them get
    merges of their own. Raises TokenizerBuildError when the corpus runs out of merges first.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 byte symbols
    minimum = len(alphabet) + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise TokenizerBuildError(
            f"vocab_size={vocab_size} is below the {minimum} entries a byte-level BPE needs "
            f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens); choose vocab_size >= {minimum}."
        )
    texts = [render_chatml(turns) for turns in load_conversations(corpus_files())]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets map to chars
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    reached = tokenizer.get_vocab_size()
    if reached != vocab_size:
        raise TokenizerBuildError(
            f"vocab_size={vocab_size} cannot be reached: the local corpus ({len(texts)} "
            f"conversations) supports at most {reached} tokens; choose vocab_size <= {reached}."
        )
    return tokenizer


def save_chatml_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int) -> None:
    """Train the tokenizer and save it as an HF fast tokenizer with the ChatML template.

    Writes tokenizer.json and tokenizer_config.json (the template inside it, as SmolLM2 ships
    it, rather than a separate chat_template.jinja).
    """
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_chatml_bpe(vocab_size),
        bos_token=IM_START,
        eos_token=IM_END,
        unk_token=ENDOFTEXT,
        pad_token=IM_END,
        chat_template=CHATML_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.save_pretrained(str(out_dir), save_jinja_files=False)
