"""Build the tiny model's tokenizer: a 512-token byte-level BPE and a GLM-5-style chat template.

Run `python models/tiny/make_tokenizer.py` to regenerate `tokenizer.json` and
`tokenizer_config.json` next to this file. Training is deterministic (fixed corpus below, single
thread), so the output is byte-identical on every run; the tiny model's vocab_size (512 in
`config.json`) must stay >= the tokenizer's size. `train_bpe` and `write_tokenizer` are also the
small trained model's tokenizer (`tools/train_small.py`, trained on its own corpus).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

VOCAB_SIZE = 512
# GLM's control tokens; eos for generation = <|endoftext|>, <|user|>, <|observation|> (as GLM-5).
SPECIAL_TOKENS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
                  "<|user|>", "<|assistant|>", "<|observation|>"]
# GLM's markers of reasoning and tool calls: added tokens that are *not* special, as in GLM-4.5/5
# checkpoints, so they survive decoding and the server's parsers can see them in the text.
MARKER_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                 "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>"]
EOS_TOKENS = ["<|endoftext|>", "<|user|>", "<|observation|>"]

# GLM-5's chat format (zai-org's chat_template.jinja, simplified: no multimodal parts, no tool
# references): [gMASK]<sop>, a <|system|> block listing the tools as JSON, one <|role|> header per
# message with no newline after it, assistant turns as <think>reasoning</think>content followed by
# <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>, tool results as
# <tool_response> under one <|observation|>. Reasoning is kept only for turns after the last user
# message. The generation prompt is <|assistant|><think> with thinking on; unlike GLM-5, thinking
# is off unless `enable_thinking` is passed: the random-weight tiny model never closes </think>.
CHAT_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ (tool.function if tool.function is defined else tool) | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<|system|>{{ m.content }}
{%- elif m.role == 'user' -%}
<|user|>{{ m.content }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- if m.reasoning_content is string and loop.index0 > ns.last_user -%}
{{ '<think>' + m.reasoning_content + '</think>' }}
{%- else -%}
{{ '<think></think>' }}
{%- endif -%}
{%- if m.content and m.content.strip() -%}{{ m.content.strip() }}{%- endif -%}
{%- for tc in m.tool_calls or [] -%}
{%- set fn = tc.function if tc.function is defined else tc -%}
<tool_call>{{ fn.name }}
{%- for k, v in fn.arguments.items() -%}
<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson(ensure_ascii=False) }}</arg_value>
{%- endfor -%}
</tool_call>
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}
<tool_response>{{ m.content }}</tool_response>
{%- else -%}
{{ raise_exception('unknown role: ' ~ m.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>{{ '<think>' if enable_thinking is defined and enable_thinking else '<think></think>' }}
{%- endif -%}"""

CORPUS = """
The quick brown fox jumps over the lazy dog. A serving engine turns prompts into tokens, tokens
into key and value vectors, and vectors into the next token, one step at a time. Hello, world!
Requests arrive, wait in a queue, and join the running batch when there is room in the cache.
The scheduler decides which requests run in each step. Long prompts are split into chunks so that
decoding requests keep their pace. When memory runs out, the newest request steps back and waits.
A prefix cache keeps the pages of prompts it has seen; a repeated system prompt costs nothing.
Pages hold sixty-four tokens each. Every page stores the latent key, the rotary key, and the
indexer key of the sparse attention, so a cache hit saves all three.
The model reads the question, thinks, and answers. What is the capital of France? Paris is the
capital of France. How many legs does a spider have? A spider has eight legs. Count to ten:
one, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100.
You are a helpful assistant. Please answer briefly and clearly. Thank you! Good morning.
Write a short poem about the sea: the sea is wide, the sea is deep, the waves roll in, the gulls
will sleep. Tell me a story about a robot who learns to paint. Once upon a time there was a
small robot who loved colours: red, green, blue, yellow, orange, purple, black and white.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
{"role": "user", "content": "hi"} [1, 2, 3] (x + y) * z = 7; if (n > 0) { return n - 1; }
Graphs, passes, kernels and plans: the compiler lowers the model, the runtime serves it.
Temperature, top-p, top-k and penalties shape the distribution; a seed makes sampling repeat.
"""


def train_bpe(texts, vocab_size: int):
    """A byte-level BPE (`tokenizers`) with GLM's control and marker tokens first (ids 0..19),
    trained on the strings `texts`; single-threaded merges, so ties break the same on every run."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=SPECIAL_TOKENS + MARKER_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def write_tokenizer(tok, out_dir: Path, model_max_length: int = 4096) -> None:
    """Write `tok` as `tokenizer.json` (markers not special) and a `tokenizer_config.json` with
    GLM's eos tokens and chat template, the files glmc's tokenizer and transformers read."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = json.loads(tok.to_str())
    for added in data["added_tokens"]:  # the trainer makes every added token special
        added["special"] = added["content"] not in MARKER_TOKENS
    text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
    (out_dir / "tokenizer.json").write_text(text, encoding="utf-8")  # byte-level BPE tokens are not ASCII
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "eos_token": EOS_TOKENS[0],
        "pad_token": EOS_TOKENS[0],
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "eos_token_ids": [tok.token_to_id(t) for t in EOS_TOKENS],
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def build(out_dir: Path) -> None:
    tok = train_bpe([line for line in CORPUS.splitlines() if line] * 4, VOCAB_SIZE)
    write_tokenizer(tok, out_dir)
    print(f"wrote {out_dir}/tokenizer.json ({tok.get_vocab_size()} tokens) and tokenizer_config.json")


if __name__ == "__main__":
    build(Path(__file__).resolve().parent)
