"""Tokenizer: a `tokenizers` tokenizer.json plus the special tokens and chat template from tokenizer_config.json.

`train_byte_bpe` makes the built-in tiny model's byte-level BPE from a small built-in text, with no
download: every byte is in the base alphabet, so any UTF-8 text encodes and round-trips.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

BOS, EOS, PAD = "<|begin_of_sentence|>", "<|end_of_sentence|>", "<|pad|>"
# The tiny model's chat template, in the Hugging Face (Jinja) format: BOS, then "<|role|>\ncontent\n" per
# message, then "<|assistant|>\n" to prompt a reply. Plain text: the byte-level BPE encodes the markers as is.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
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


def train_byte_bpe(vocab_size: int, texts: Iterable[str] | None = None) -> HFTokenizer:
    """A byte-level BPE of exactly `vocab_size` ids (3 special tokens first: bos=0, eos=1, pad=2),
    trained on `texts` (default: a small built-in text)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4 if texts is None else texts, trainer=trainer)
    return tok


def save_tokenizer(tok: HFTokenizer, path: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (special tokens, chat template) into `path`.

    Each file is written under a temporary name of its own and renamed, config last: processes upgrading
    the same cached checkpoint at once never see a half-written file, and a current config means a
    complete tokenizer.json.
    """
    tmp = path / f"tokenizer.json.{uuid.uuid4().hex}.tmp"
    tok.save(str(tmp))
    tmp.replace(path / "tokenizer.json")
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "chat_template": CHAT_TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    tmp = path / f"tokenizer_config.json.{uuid.uuid4().hex}.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(path / "tokenizer_config.json")


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
        template = self.config.get("chat_template")
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            # newer transformers save the template beside tokenizer_config.json instead of in it
            template = jinja_file.read_text()
        self._template_source = template
        # a family whose checkpoints ship no template (DeepSeek's) renders chat with its own encoder
        self._family_chat = _family_chat(path) if template is None else None
        self.bos_id = self._special_id("bos_token")
        self.eos_id = self._special_id("eos_token")

    def _special_token(self, key: str) -> str | None:
        token = self.config.get(key)
        if isinstance(token, dict):  # {"content": "...", ...} form
            token = token.get("content")
        return token or None

    def _special_id(self, key: str) -> int | None:
        token = self._special_token(key)
        return self._tok.token_to_id(token) if token else None

    @cached_property
    def _chat_template(self) -> jinja2.Template:
        source = self._template_source
        if isinstance(source, list):  # [{"name": ..., "template": ...}]: several named templates
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            raise ValueError("this model's tokenizer_config.json has no chat_template; use /v1/completions")
        # Hugging Face's rendering environment, so templates written for transformers render the same here;
        # the sandbox keeps a checkpoint's template away from Python internals
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise_template_error
        try:
            return env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"this model's chat_template does not parse ({e.message}, line {e.lineno}); "
                             "fix it in tokenizer_config.json or use /v1/completions") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json holds it (for libraries that build their own from it)."""
        return self._tok.to_str()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`, after BOS when `add_bos`. Special tokens written in the text (as a chat
        template writes BOS) encode as themselves, so encode `apply_chat_template`'s text with add_bos=False."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else ids

    def token_string(self, token_id: int) -> str:
        """The vocabulary entry of `token_id` as the tokenizer stores it (byte-level pieces as such)."""
        return self._tok.id_to_token(token_id)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """`messages` ([{"role", "content"}]) as prompt text, rendered by the checkpoint's chat template, or
        without one by its family's own encoder (DeepSeek-V4 and V4.1: `rackserve.models.deepseek_v4.chat`),
        which always ends with the reply's opening.

        The text starts with BOS when the template writes it (most do): encode it with add_bos=False.
        add_generation_prompt ends the text with the assistant's turn opening, so the model replies.
        Raises ValueError when the checkpoint has neither or either refuses the messages.
        """
        if self._family_chat is not None:
            if not add_generation_prompt:
                raise ValueError("this model's chat encoding always ends a conversation with the opening of the "
                                 "reply; send add_generation_prompt true")
            # chat mode: until the endpoint returns reasoning apart from the answer, a reply that reasons
            # first would put its reasoning in the content
            return self._family_chat(messages, thinking=False)
        try:
            return self._chat_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              bos_token=self._special_token("bos_token") or "",
                                              eos_token=self._special_token("eos_token") or "")
        except jinja2.TemplateError as e:
            raise ValueError(f"this model's chat template cannot render these messages: {e}") from None


def _family_chat(path: Path):
    """The chat encoder of the family of the checkpoint at `path` (its config.json), if it has one."""
    from rackserve.config import ConfigError
    from rackserve.models import family_of, read_config_json  # the registry imports the families' models

    try:
        return family_of(read_config_json(path)).chat
    except ConfigError:  # no config.json, or not one of ours: no encoder, the chat endpoint says so
        return None


def _raise_template_error(message: str) -> None:
    # templates call raise_exception(...) to refuse a conversation, e.g. roles that do not alternate
    raise jinja2.TemplateError(message)
