"""The OpenAI wire format of answers: whole responses, SSE chunks, logprobs and usage.

`Formatter` renders engine output in OpenAI's chat or legacy completions layout. A chat choice's
text goes through `glm_output.ChatOutput` first, which splits it into `reasoning_content`,
`content` and `tool_calls` (finish_reason "tool_calls" when the model called one). No engine, no
HTTP here.
"""
from __future__ import annotations

import codecs
import json
import time

from glmc.runtime.engine.tokenizer import Tokenizer
from glmc.runtime.serving.glm_output import ChatOutput


def merge(a: dict, b: dict) -> dict:
    """Two chat deltas as one: texts concatenated, tool calls appended."""
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, [] if k == "tool_calls" else "") + v
    return out


def finish_reason(reason: str | None, output: ChatOutput | None) -> str | None:
    return "tool_calls" if reason == "stop" and output is not None and output.called_tools \
        else reason


class Formatter:
    """Responses and SSE chunks of one model, in OpenAI's chat or legacy completions layout."""

    def __init__(self, model_name: str, tokenizer: Tokenizer):
        self.model_name, self.tokenizer = model_name, tokenizer

    def head(self, rid: str, chat: bool, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else \
            "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model_name}

    def chunk(self, head: dict, chat, index, delta, finish_reason, lp) -> str:
        """One SSE chunk; `head` is the call's `head(rid, chat, True)`, made once per stream."""
        choice = {"index": index, "finish_reason": finish_reason,
                  "logprobs": self.logprobs(lp, chat)}
        choice |= {"delta": delta} if chat else {"text": delta}
        return sse_data({**head, "choices": [choice]})

    def response(self, rid, chat, reqs, choices, counts, n, outputs) -> dict:
        """`outputs[i]` is choice i's `ChatOutput` (chat) or None (completions)."""
        out = []
        for i, c in enumerate(choices):
            body = {"message": self.message(c["text"], outputs[i])} if chat \
                else {"text": c["text"]}  # first: the message says whether a tool was called
            out.append({"index": i, "finish_reason": finish_reason(c["finish_reason"], outputs[i]),
                        "logprobs": self.logprobs(c["logprobs"] if reqs[i].params.logprobs
                                                  else None, chat), **body})
        return {**self.head(rid, chat, False), "choices": out, "usage": usage(counts, n)}

    @staticmethod
    def message(text: str, output: ChatOutput) -> dict:
        parts = merge(output.feed(text), output.finish())
        calls = parts.get("tool_calls")
        message = {"role": "assistant", "content": parts.get("content", None if calls else "")}
        if "reasoning_content" in parts:
            message["reasoning_content"] = parts["reasoning_content"]
        if calls:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
        return message

    def logprobs(self, items, chat: bool):
        """OpenAI logprobs: chat's `content` list, or the legacy completions layout."""
        if items is None:
            return None
        tok = self.tokenizer
        name = tok.id_to_token

        def entry(t, lp):
            return {"token": name(t), "logprob": lp, "bytes": list(tok.token_bytes(t))}
        if chat:
            return {"content": [entry(t, lp.logprob) | {"top_logprobs": [
                entry(a, b) for a, b in lp.top]} for t, lp in items]}
        return {"tokens": [name(t) for t, _ in items], "token_logprobs": [lp.logprob for _, lp in items],
                "top_logprobs": [{name(a): b for a, b in lp.top} for _, lp in items],
                "text_offset": self.text_offsets([t for t, _ in items])}

    def text_offsets(self, ids: list[int]) -> list[int]:
        """Where each token starts in the text (a character split over tokens counts where it
        completes)."""
        dec, pos, out = codecs.getincrementaldecoder("utf-8")("ignore"), 0, []
        for t in ids:
            out.append(pos)
            pos += len(dec.decode(self.tokenizer.token_bytes(t)))
        return out


def sse_data(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def usage(counts: list, n: int) -> dict:
    """Token counts; a prompt shared by `n` choices counts once, as OpenAI does."""
    done = [c for c in counts if c is not None]
    firsts = [c for i, c in enumerate(counts) if i % n == 0 and c is not None]
    prompt = sum(c.num_prompt_tokens for c in firsts)
    completion = sum(c.num_output_tokens for c in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in firsts)}}
