"""Tokenizer: a `tokenizers` tokenizer.json plus the special tokens from tokenizer_config.json.

`train_byte_bpe` makes the built-in tiny model's byte-level BPE from a small built-in text, with no
download: every byte is in the base alphabet, so any UTF-8 text encodes and round-trips.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

BOS, EOS, PAD = "<|begin_of_sentence|>", "<|end_of_sentence|>", "<|pad|>"
# A minimal chat template in the Hugging Face (Jinja) format, used by the chat endpoint.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_CORPUS = """\
A rack of GPUs serves a mixture-of-experts model. Each request arrives over HTTP, is prefilled on one
instance and decoded on another; its state moves between them over the network. Experts are placed so
that every rank carries a similar load, and the ranks advance together, step by step, in lockstep.
The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' "
Tokens stream back to the user as soon as they are sampled: hello, world! The rack hums.
def forward(self, batch, state): return self.lm_head(self.norm(hidden))
Ünïcödé, 日本語, emoji 🚀 and other bytes must survive encoding and decoding unchanged.
"""


def train_byte_bpe(vocab_size: int) -> HFTokenizer:
    """A byte-level BPE of exactly `vocab_size` ids (3 special tokens first: bos=0, eos=1, pad=2)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok


def save_tokenizer(tok: HFTokenizer, path: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (special tokens, chat template) into `path`."""
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "chat_template": CHAT_TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


class Tokenizer:
    """Text <-> token ids for a checkpoint directory with a tokenizer.json."""

    def __init__(self, path: str | Path):
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}; the checkpoint needs one to take text prompts")
        self._tok = HFTokenizer.from_file(str(file))
        cfg_file = path / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.bos_id = self._special_id("bos_token")
        self.eos_id = self._special_id("eos_token")

    def _special_id(self, key: str) -> int | None:
        token = self.config.get(key)
        if isinstance(token, dict):  # {"content": "...", ...} form
            token = token.get("content")
        return self._tok.token_to_id(token) if token else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
