"""Text <-> token ids for a Hugging Face model directory, without transformers.

Reads tokenizer.json (the `tokenizers` library does the work), tokenizer_config.json (special
tokens, chat template) and generation_config.json (stop ids). Chat templates are Jinja rendered
in a sandbox with the variables and helpers transformers provides, so templates written for
transformers render identically. `StreamDecoder` turns a growing id sequence into text deltas
that never split a multi-byte character and add up exactly to `decode(all ids)`.
"""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as Backend

logger = logging.getLogger(__name__)

KNOWN_ROLES = ("system", "user", "assistant", "tool", "developer", "ipython")
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A model's tokenizer and chat template. Build with `Tokenizer.from_dir`."""

    def __init__(
        self,
        backend: Backend,
        *,
        special_tokens: Mapping[str, str | None],
        chat_template: str | None = None,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.special_tokens = dict(special_tokens)
        self.chat_template = chat_template
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.bos_token_id = bos_token_id
        self._template: jinja2.Template | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and generation_config.json of a model."""
        directory = Path(model_dir)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"no tokenizer.json in {directory}; specrun reads fast-tokenizer files only "
                "(save the tokenizer with transformers' save_pretrained to create one)"
            )
        backend = Backend.from_file(str(path))
        config = _read_json(directory / "tokenizer_config.json")
        generation = _read_json(directory / "generation_config.json")
        model_config = _read_json(directory / "config.json")
        special = {
            name: _token_content(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        eos_ids = [*_ids(model_config.get("eos_token_id")), *_ids(generation.get("eos_token_id"))]
        if special["eos_token"] is not None:
            token_id = backend.token_to_id(special["eos_token"])
            eos_ids += [] if token_id is None else [token_id]
        bos_id = generation.get("bos_token_id")
        if bos_id is None and special["bos_token"] is not None:
            bos_id = backend.token_to_id(special["bos_token"])
        return cls(
            backend,
            special_tokens=special,
            chat_template=_chat_template(directory, config),
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
        )

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds BOS/EOS where the tokenizer asks for it."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}; decode bytes first")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of a sequence of token ids (invalid UTF-8 comes out as U+FFFD)."""
        return self.backend.decode(
            _check_ids(ids, self.vocab_size), skip_special_tokens=skip_special_tokens
        )

    def stream_decoder(self, *, skip_special_tokens: bool = False) -> StreamDecoder:
        """A fresh incremental detokenizer for one generated sequence."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        **template_vars: Any,
    ) -> str:
        """Render a conversation with the model's chat template.

        messages: [{"role": "user" | "assistant" | "system" | ..., "content": str}, ...].
        template_vars: extra variables some templates read (tools, documents, ...).
        """
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat_template in tokenizer_config.json; encode raw text "
                "instead (EngineConfig(chat_template=False) / `generate --raw`)"
            )
        messages = _check_messages(messages)
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        variables = {"tools": None, "documents": None, **self.special_tokens, **template_vars}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template rejected these messages: {e}") from e


class StreamDecoder:
    """Incremental detokenizer: `push` ids as they are generated, then `flush` once.

    Each delta is decoded from a short window of recent ids, so the cost per token does not
    grow with the sequence. Text is held back while it ends in an incomplete UTF-8 sequence
    (decoded as U+FFFD), and `flush` returns whatever makes the concatenation of all deltas
    equal `tokenizer.decode(all ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._emitted: list[str] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self.tokenizer.decode(
            self.ids[start:stop], skip_special_tokens=self.skip_special_tokens
        )

    def push(self, token_id: int) -> str:
        """Add one generated id; returns the newly printable text (often "")."""
        self.ids.append(int(token_id))
        prefix = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset)
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return self._emit(text[len(prefix) :])

    def extend(self, token_ids: Sequence[int]) -> str:
        """`push` several ids; returns their combined delta."""
        return "".join(self.push(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """The rest of the text, held-back bytes included; call once at the end."""
        emitted = "".join(self._emitted)
        full = self._decode(0)
        if full.startswith(emitted):
            tail = full[len(emitted) :]
        else:
            logger.warning("streamed text diverged from the full decode; appending the tail only")
            prefix = self._decode(self._prefix_offset, self._read_offset)
            tail = self._decode(self._prefix_offset)[len(prefix) :]
        self._prefix_offset = self._read_offset = len(self.ids)
        return self._emit(tail)

    def _emit(self, delta: str) -> str:
        self._emitted.append(delta)
        return delta


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in (same whitespace rules)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate a conversation; returns plain dict copies for the template."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            "messages must be a list of {'role': ..., 'content': ...} dicts, got "
            f"{type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty; give at least one {'role': 'user', 'content': ...}")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str):
            raise TypeError(f"messages[{index}]['role'] must be a str, got {type(role).__name__}")
        if role not in KNOWN_ROLES:
            raise ValueError(f"messages[{index}] has role {role!r}; use one of {KNOWN_ROLES}")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise TypeError(
                f"messages[{index}]['content'] must be a str (or a list of parts), got "
                f"{type(content).__name__}"
            )
        checked.append(dict(message))
    return checked


def _check_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    if isinstance(ids, (str, bytes)):
        raise TypeError("ids must be a sequence of ints; to tokenize text use encode()")
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return ids


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja (transformers >= 4.43 saves it there) or tokenizer_config's."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _token_content(token: Any) -> str | None:
    """Special tokens are stored as strings or as serialized AddedToken dicts."""
    if isinstance(token, Mapping):
        return token.get("content")
    return token


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return json.load(f)
