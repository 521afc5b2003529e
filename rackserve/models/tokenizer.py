"""Tokenizer: a `tokenizers` tokenizer.json plus the special tokens and chat template from tokenizer_config.json.

`train_byte_bpe` makes the tiny models' byte-level BPE from a small built-in text, with no download: every
byte is in the base alphabet, so any UTF-8 text encodes and round-trips. Its special tokens and chat
template follow a family's `Conventions`, so a tiny checkpoint is tokenized and chats as the family's
published ones do (DeepSeek's: their role tokens and no jinja template; Qwen3's: ChatML and its template).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
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


@dataclass(frozen=True)
class Conventions:
    """A family's tokenizer conventions: its special tokens and chat template as its checkpoints ship them.

    first: the special tokens taking ids 0, 1, 2 (a tiny config's bos, eos and pad ids); bos, eos, pad: which
    of them tokenizer_config.json names so (bos None: the family adds no BOS); control: more special tokens
    (role markers, dropped from decoded text); markup: added tokens that stay in decoded text (reasoning
    and tool-call markers, which reply parsing reads); chat_template: the jinja template, None when the
    family renders chat with its own encoder (`ModelFamily.chat`)."""

    first: tuple[str, str, str]
    bos: str | None
    eos: str
    pad: str
    control: tuple[str, ...] = ()
    markup: tuple[str, ...] = ()
    chat_template: str | None = None

    def tokenizer_config(self) -> dict:
        """tokenizer_config.json as this family's checkpoints have it."""
        config = {"bos_token": self.bos, "eos_token": self.eos, "pad_token": self.pad,
                  "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
        return config if self.chat_template is None else {**config, "chat_template": self.chat_template}

    def written_in(self, path: Path) -> bool:
        """Whether `path`'s tokenizer files are today's for these conventions (a cache may hold older ones)."""
        try:
            config = json.loads((path / "tokenizer_config.json").read_text())
            added = {t["content"] for t in json.loads((path / "tokenizer.json").read_text())["added_tokens"]}
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return False
        return config == self.tokenizer_config() and added == {*self.first, *self.control, *self.markup}


# the tiny-code model's tokenizer and any checkpoint of ours that wants a plain template
RACKSERVE = Conventions(first=(BOS, EOS, PAD), bos=BOS, eos=EOS, pad=PAD, chat_template=CHAT_TEMPLATE)


def train_byte_bpe(vocab_size: int, texts: Iterable[str] | None = None,
                   conventions: Conventions = RACKSERVE) -> HFTokenizer:
    """A byte-level BPE of exactly `vocab_size` ids trained on `texts` (default: a small built-in text): the
    conventions' `first` tokens at ids 0, 1, 2, their control tokens next, their markup tokens last."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(conventions.markup),
        special_tokens=[*conventions.first, *conventions.control],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4 if texts is None else texts, trainer=trainer)
    # not special: decoded text keeps them, as it keeps <think> in the families' own tokenizers
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in conventions.markup])
    return tok


def save_tokenizer(tok: HFTokenizer, path: Path, conventions: Conventions = RACKSERVE) -> None:
    """Write tokenizer.json and tokenizer_config.json (`conventions`' special tokens, chat template) into `path`.

    Each file is written under a temporary name of its own and renamed, config last: processes upgrading
    the same cached checkpoint at once never see a half-written file, and a current config means a
    complete tokenizer.json.
    """
    tmp = path / f"tokenizer.json.{uuid.uuid4().hex}.tmp"
    tok.save(str(tmp))
    tmp.replace(path / "tokenizer.json")
    config = conventions.tokenizer_config()
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
        family = _family(path)
        # a family whose checkpoints ship no template (DeepSeek's) renders chat with its own encoder
        self._family_chat = family.chat if family is not None and template is None else None
        self.reply_format = family.reply if family is not None else None  # how its replies mark reasoning, calls
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
    def _template_text(self) -> str:
        source = self._template_source
        if isinstance(source, list):  # [{"name": ..., "template": ...}]: several named templates
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            raise ValueError("this model's tokenizer_config.json has no chat_template; use /v1/completions")
        return source

    @cached_property
    def _chat_template(self) -> jinja2.Template:
        source = self._template_text
        # Hugging Face's rendering environment, so templates written for transformers render the same here;
        # the sandbox keeps a checkpoint's template away from Python internals
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise_template_error
        env.filters["tojson"] = _tojson  # transformers' own: jinja's escapes HTML and sorts keys
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

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            options: ChatOptions | None = None) -> str:
        """`messages` (OpenAI chat messages: roles, text content, assistant tool_calls, tool results) as prompt
        text, rendered by the checkpoint's chat template, or without one by its family's own encoder
        (DeepSeek-V4 and V4.1: `rackserve.models.deepseek_v4.chat`), which always ends with the reply's opening.

        The text starts with BOS when the template writes it (most do): encode it with add_bos=False.
        add_generation_prompt ends the text with the assistant's turn opening, so the model replies.
        options: tools, thinking, reasoning effort and response format (`ChatOptions`). A template is given
        only what it reads: one that reads no `tools` (or `tool_calls`, thinking, effort) refuses a request
        that has them, instead of leaving them out of the prompt.
        Raises ValueError when the checkpoint has neither or either refuses the messages.
        """
        options = options or ChatOptions()
        if self._family_chat is not None:
            if not add_generation_prompt:
                raise ValueError("this model's chat encoding always ends a conversation with the opening of the "
                                 "reply; send add_generation_prompt true")
            return self._family_chat(messages, tools=options.tools, thinking=options.thinking,
                                     reasoning_effort=options.reasoning_effort,
                                     response_format=options.response_format)
        read = self._template_reads
        given = {"tools": options.tools, "enable_thinking": options.thinking,
                 "reasoning_effort": options.reasoning_effort}
        unread = [name for name, value in given.items() if value is not None and name not in read]
        if any(m.get("tool_calls") for m in messages) and "tool_calls" not in self._template_text:
            unread.append("tool_calls")
        if unread:
            raise ValueError(f"this model's chat template does not render {' or '.join(unread)}; leave "
                             f"{'them' if len(unread) > 1 else 'it'} out for this model")
        # text parts are lines of one message, as vLLM joins them for a template
        messages = [{**m, "content": "\n".join(p["text"] for p in m["content"])}
                    if isinstance(m.get("content"), list) else m for m in messages]
        try:
            return self._chat_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              bos_token=self._special_token("bos_token") or "",
                                              eos_token=self._special_token("eos_token") or "",
                                              **{k: v for k, v in given.items() if v is not None})
        except jinja2.TemplateError as e:
            raise ValueError(f"this model's chat template cannot render these messages: {e}") from None
        except Exception as e:  # a template's expressions raise what Python raises (1 + "a": a TypeError)
            raise ValueError(f"this model's chat template failed on these messages ({type(e).__name__}: {e}); "
                             "fix the checkpoint's chat_template or send a prompt to /v1/completions") from None

    def template_mentions(self, text: str) -> bool:
        """Whether the checkpoint's jinja chat template writes `text` anywhere (False without one)."""
        return isinstance(self._template_source, str) and text in self._template_source

    @cached_property
    def _template_reads(self) -> frozenset[str]:
        """The variables the chat template reads from its caller."""
        template = self._chat_template  # one that does not parse is refused there, with its message
        return frozenset(jinja2.meta.find_undeclared_variables(template.environment.parse(self._template_text)))


@dataclass(frozen=True)
class ChatOptions:
    """What a chat request asks of the prompt beyond its messages.

    tools: OpenAI tool definitions; thinking: reasoning mode on or off (None: the family's default; a jinja
    template gets it as `enable_thinking`); reasoning_effort: OpenAI's level names, or V4.1's 1-100;
    response_format: OpenAI's, for an encoder that states it in the prompt (DeepSeek's do; the grammar
    enforces it either way)."""

    tools: list[dict[str, Any]] | None = None
    thinking: bool | None = None
    reasoning_effort: str | int | None = None
    response_format: dict[str, Any] | None = None


def _family(path: Path):
    """The family of the checkpoint at `path` (its config.json), if it is one of ours."""
    from rackserve.config import ConfigError
    from rackserve.models import family_of, read_config_json  # the registry imports the families' models

    try:
        return family_of(read_config_json(path))
    except ConfigError:  # no config.json, or not one of ours: no encoder, the chat endpoint says so
        return None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    # templates call raise_exception(...) to refuse a conversation, e.g. roles that do not alternate
    raise jinja2.TemplateError(message)


def prompt_ids(tokenizer: Tokenizer | None, prompt: str | Iterable[int]) -> list[int]:
    """A prompt as its caller gave it, as token ids: text encoded (a `ValueError` naming the fix when the
    checkpoint has no tokenizer.json), ids as they are (the engine checks them). Where text comes in
    (the endpoint, `LLM`, `Instance`, `Deployment`) it is tokenized once, here; every call below takes ids."""
    if not isinstance(prompt, str):
        return list(prompt)
    if tokenizer is None:
        raise ValueError("this model has no tokenizer.json; send token ids instead of text")
    return tokenizer.encode(prompt)
