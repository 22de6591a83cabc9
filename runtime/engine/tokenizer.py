"""Text <-> token ids, chat formatting and streaming detokenization with stop strings.

Reads a Hugging Face tokenizer directory: `tokenizer.json` (the `tokenizers` library's format) and
`tokenizer_config.json` (chat_template, eos token); eos ids are also taken from `config.json` and
`generation_config.json` when present, as GLM checkpoints list several there. Chat templates are
rendered like `transformers` does (sandboxed jinja2, trim_blocks, lstrip_blocks, raise_exception).
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table used by byte-level BPE, as char -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    extra = [b for b in range(256) if b not in keep]
    chars = keep + [256 + i for i in range(len(extra))]
    return {chr(c): b for c, b in zip(chars, keep + extra)}


_BYTE_OF = _byte_level_alphabet()


class TemplateError(ValueError):
    """The chat template rejected the messages (e.g. an unknown role)."""


def _raise(message: str):
    raise TemplateError(message)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the chat template and eos ids of one checkpoint."""

    def __init__(self, tok: tokenizers.Tokenizer, chat_template: str | None = None,
                 eos_token_ids: list[int] = (), special: dict[str, str] | None = None):
        self.tok, self.chat_template = tok, chat_template
        self.eos_token_ids = frozenset(eos_token_ids)
        self.special = special or {}
        self._template = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"{path}/tokenizer.json not found")
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        special = {k: v if isinstance(v, str) else v.get("content", "")
                   for k, v in cfg.items() if k in ("bos_token", "eos_token", "pad_token") and v}
        eos = set(_as_list(cfg.get("eos_token_ids")))
        if special.get("eos_token") and tok.token_to_id(special["eos_token"]) is not None:
            eos.add(tok.token_to_id(special["eos_token"]))
        for name in ("config.json", "generation_config.json"):
            eos.update(_as_list(_read_json(path / name).get("eos_token_id")))
        return cls(tok, template, sorted(eos), special)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        # Special tokens written in the text (e.g. by the chat template) are recognised as such.
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The text of one token, for logprobs (partial UTF-8 shows as U+FFFD)."""
        return self.tok.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (exact for byte-level BPE, where one token may hold part
        of a UTF-8 character); else the UTF-8 of its text."""
        piece = self.tok.id_to_token(token_id) or ""
        if all(ch in _BYTE_OF for ch in piece) and piece:
            return bytes(_BYTE_OF[ch] for ch in piece)
        return self.id_to_token(token_id).encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        if self.chat_template is None:
            raise TemplateError("this model's tokenizer_config.json has no chat_template")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent,
                                                                         ensure_ascii=False)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special, **kwargs)
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template: {e}") from e


class Detokenizer:
    """Turns one request's growing output ids into text deltas, applying stop strings.

    Decodes a short window (vLLM's prefix/read offsets) so each step costs O(1) tokens; holds back
    text ending in an incomplete UTF-8 sequence and any tail that could begin a stop string. When a
    stop string appears, the text is cut before it and `stopped` becomes True.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str] = ()):
        self.tokenizer, self.stop = tokenizer, list(stop)
        self.ids: list[int] = []
        self.text, self.sent = "", 0  # all text so far; how much of it was handed out
        self.stopped = False
        self._prefix, self._read = 0, 0

    def add(self, token_id: int) -> str:
        """Append one output token; returns the text that is now safe to send."""
        if not self.stopped:
            self.ids.append(token_id)
            dec = self.tokenizer.decode
            before = dec(self.ids[self._prefix:self._read])
            after = dec(self.ids[self._prefix:])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self._check_stop(after[len(before):])
                self._prefix, self._read = self._read, len(self.ids)
        end = len(self.text) if self.stopped else len(self.text) - self._held_back()
        return self._send(end)

    def flush(self) -> str:
        """The request is over: hand out whatever was held back for a possible stop string."""
        return self._send(len(self.text))

    def _send(self, end: int) -> str:
        delta, self.sent = self.text[self.sent:end], max(self.sent, end)
        return delta

    def _check_stop(self, delta: str) -> None:
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += delta
        hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        return max((k for s in self.stop for k in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:k])), default=0)
