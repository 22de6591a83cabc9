"""Text <-> token ids, chat formatting and streaming detokenization with stop strings.

Reads a Hugging Face tokenizer directory: `tokenizer.json` (the `tokenizers` library's format) and
`tokenizer_config.json` (chat_template, eos token); eos ids are also taken from `config.json` and
`generation_config.json` when present, as GLM checkpoints list several there. Chat templates are
rendered like `transformers` does (sandboxed jinja2, trim_blocks, lstrip_blocks, raise_exception).

Control tokens come only from the chat template. `render_chat` replaces the text of every added
token (`<|user|>`, `<think>`, ...) found in a string of the request with a placeholder before the
template runs; `encode_chat` encodes the template's own text normally and each placeholder's
original text as plain text (`encode_plain`), so typed markers stay characters. Encoding goes
through `encode_batch`, which releases the GIL: a long prompt does not stall the event loop.
"""
from __future__ import annotations

import datetime
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
import tokenizers

# One-item batches gain nothing from tokenizers' thread pool, and using it before a fork makes
# every child print a warning: keep it off unless the user chose.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Markers the server's output parsers read (reasoning, tool calls): kept in decoded text even
# where a checkpoint marks them special. Every other special token is dropped from output text.
OUTPUT_MARKERS = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>",
                            "</arg_key>", "<arg_value>", "</arg_value>"})
# Placeholder for escaped request text: \ue000<index>\ue001 (private-use characters; one typed in a
# request is escaped itself, so a placeholder in the rendered text is always ours).
_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
MAX_NESTING = 64  # depth of request objects handed to the template (tools, tool-call arguments)


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


@dataclass
class ChatPrompt:
    """A rendered chat template whose request strings are escaped (see the module docstring)."""

    text: str
    literals: list[str] = field(default_factory=list)  # placeholder i stands for literals[i]

    @property
    def num_bytes(self) -> int:
        """UTF-8 size of the prompt text (placeholders counted as what they stand for)."""
        return len(self.text.encode("utf-8", "surrogatepass")) + sum(
            len(x.encode("utf-8", "surrogatepass")) for x in self.literals)

    @property
    def thinking(self) -> bool:
        """The prompt leaves a `<think>` block open: the output starts with reasoning."""
        return self.text.endswith("<think>")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the chat template and eos ids of one checkpoint."""

    def __init__(self, tok: tokenizers.Tokenizer, chat_template: str | None = None,
                 eos_token_ids: list[int] = (), special: dict[str, str] | None = None):
        self.tok, self.chat_template = tok, chat_template
        self.eos_token_ids = frozenset(eos_token_ids)
        self.special = special or {}
        self._template, self._variables = None, None
        added = tok.get_added_tokens_decoder()
        self.added_tokens = {a.content: i for i, a in added.items()}
        self.control_ids = frozenset(i for i, a in added.items()
                                     if a.special and a.content not in OUTPUT_MARKERS)
        self._plain = _without_added_tokens(tok)
        texts = sorted(self.added_tokens, key=len, reverse=True) + [_OPEN]
        self._marker_re = re.compile("|".join(map(re.escape, texts)))
        self._max_token_bytes: int | None = None

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

    def __getstate__(self) -> dict:
        """Picklable (the HTTP process gets a copy): the compiled chat template is made again."""
        return {**self.__dict__, "_template": None}

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    @property
    def max_token_bytes(self) -> int:
        """Most UTF-8 bytes one token stands for, widened when a normalizer may shrink text
        (NFC joins up to 3 jamo into one syllable): prompt bytes / this <= its token count."""
        if self._max_token_bytes is None:
            longest = max(len(self.token_bytes(i)) for i in range(self.vocab_size))
            self._max_token_bytes = longest * (4 if self.tok.normalizer is not None else 1)
        return self._max_token_bytes

    # -- text -> ids -----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; the text of added tokens in it becomes those tokens (for the chat
        template's output, or a completion prompt that asks for it)."""
        return _encode(self.tok, text)

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` read as plain text: no control token or marker, whatever it says."""
        return _encode(self._plain, text)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    **kwargs) -> ChatPrompt:
        """The chat template over `messages` (and `tools=...` or other template variables), every
        string of which is escaped first: it can never become a control token."""
        literals: list[str] = []
        safe = self._escape({"messages": messages, **kwargs}, literals, 0)
        text = self.apply_chat_template(safe.pop("messages"), add_generation_prompt, **safe)
        return ChatPrompt(text, literals)

    def encode_chat(self, prompt: ChatPrompt) -> list[int]:
        """Token ids of a rendered chat: the template's text with its markers, request text plain."""
        ids, pos = [], 0
        for m in _PLACEHOLDER.finditer(prompt.text):
            ids += self.encode(prompt.text[pos:m.start()])
            ids += self.encode_plain(prompt.literals[int(m.group(1))])
            pos = m.end()
        return ids + self.encode(prompt.text[pos:])

    def _escape(self, value, literals: list[str], depth: int):
        if depth > MAX_NESTING:
            raise TemplateError(f"request objects are nested deeper than {MAX_NESTING} levels")
        if isinstance(value, str):
            def hide(m: re.Match) -> str:
                literals.append(m.group(0))
                return f"{_OPEN}{len(literals) - 1}{_CLOSE}"
            return self._marker_re.sub(hide, value)
        if isinstance(value, dict):
            return {self._escape(k, literals, depth + 1): self._escape(v, literals, depth + 1)
                    for k, v in value.items()}
        if isinstance(value, list):
            return [self._escape(v, literals, depth + 1) for v in value]
        return value

    # -- ids -> text -----------------------------------------------------------------------------

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; by default without control tokens (the output markers stay)."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.control_ids]
        return self.tok.decode(ids, skip_special_tokens=False)

    def id_to_token(self, token_id: int) -> str:
        """The text of one token, for logprobs; a token holding part of a UTF-8 character is
        written as its bytes, `bytes:\\xe4\\xbd` (OpenAI's form), never as U+FFFD."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (exact for byte-level BPE, where one token may hold part
        of a UTF-8 character); else the UTF-8 of its text."""
        piece = self.tok.id_to_token(token_id) or ""
        if piece and all(ch in _BYTE_OF for ch in piece):
            return bytes(_BYTE_OF[ch] for ch in piece)
        return self.tok.decode([token_id], skip_special_tokens=False).encode()

    # -- chat template ---------------------------------------------------------------------------

    def template_variables(self) -> frozenset[str]:
        """The names the chat template reads and does not define (`messages`, `tools`,
        `enable_thinking`, ...), less the environment's globals and the special tokens: what a
        caller can set. Empty without a template."""
        if self._variables is None:
            names = set()
            if self.chat_template is not None:
                env = self._compiled().environment
                names = jinja2.meta.find_undeclared_variables(env.parse(self.chat_template))
                names -= env.globals.keys() | self.special.keys()
            self._variables = frozenset(names)
        return self._variables

    def _compiled(self) -> jinja2.Template:
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent,
                                                                         ensure_ascii=False)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        if self.chat_template is None:
            raise TemplateError("this model's tokenizer_config.json has no chat_template")
        try:
            return self._compiled().render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **{**kwargs, **self.special})
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template: {e}") from e
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as e:
            # the template met a value of a shape it does not expect: the request's fault
            raise TemplateError(f"chat template: {type(e).__name__}: {e}") from e


def _encode(tok: tokenizers.Tokenizer, text: str) -> list[int]:
    try:  # the batch call releases the GIL while it works; `encode` holds it throughout
        return tok.encode_batch([text], add_special_tokens=False)[0].ids
    except TypeError as e:  # a lone surrogate: not text the tokenizer can take
        raise ValueError("text is not valid Unicode (it holds a lone surrogate)") from e


def _without_added_tokens(tok: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """A copy of `tok` that knows no added tokens: their text is split like any other."""
    data = json.loads(tok.to_str())
    data["added_tokens"] = []
    return tokenizers.Tokenizer.from_str(json.dumps(data))


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

    def add(self, *token_ids: int) -> str:
        """Append output tokens (one per step, or a speculative cycle's run of them, decoded
        together); returns the text that is now safe to send."""
        if not self.stopped:
            self.ids.extend(token_ids)
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
        """Length of the longest tail of the text that is a proper prefix of a stop string. Only
        the places where a stop string's first character occurs can start one: found with
        `str.find`, so a step costs about one pass over the text's last len(stop) characters per
        stop string, whatever their length (trying every length was quadratic in it)."""
        text, held = self.text, 0
        for s in self.stop:
            end = len(text) - held   # a start at or past it would not beat `held`
            i = text.find(s[0], max(len(text) - len(s) + 1, 0), end)
            while i >= 0:
                if s.startswith(text[i:]):   # the earliest start: the longest tail for `s`
                    held = len(text) - i
                    break
                i = text.find(s[0], i + 1, end)
        return held
