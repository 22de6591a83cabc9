"""Build the tiny model's tokenizer: a 512-token byte-level BPE and a GLM-style chat template.

Run `python models/tiny/make_tokenizer.py` to regenerate `tokenizer.json` and
`tokenizer_config.json` next to this file. Training is deterministic (fixed corpus below, single
thread), so the output is byte-identical on every run; the tiny model's vocab_size (512 in
`config.json`) must stay >= the tokenizer's size.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

VOCAB_SIZE = 512
# GLM's special tokens; eos for generation = <|endoftext|>, <|user|>, <|observation|> (as GLM-5).
SPECIAL_TOKENS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
                  "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>"]
EOS_TOKENS = ["<|endoftext|>", "<|user|>", "<|observation|>"]

# GLM layout: [gMASK]<sop>, one <|role|> header per message with its content on the next line, and a
# bare <|assistant|> as the generation prompt (as GLM-4.5/5 with thinking off).
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'observation', 'tool'] %}"
    "{{- raise_exception('unknown role: ' ~ message['role']) }}"
    "{%- endif %}"
    "{%- set role = 'observation' if message['role'] == 'tool' else message['role'] %}"
    "<|{{ role }}|>\n{{ message['content'] }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)

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


def build(out_dir: Path) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # single-threaded merges: deterministic ties
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([line for line in CORPUS.splitlines() if line] * 4, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "eos_token": EOS_TOKENS[0],
        "pad_token": EOS_TOKENS[0],
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "eos_token_ids": [tok.token_to_id(t) for t in EOS_TOKENS],
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out_dir}/tokenizer.json ({tok.get_vocab_size()} tokens) and tokenizer_config.json")


if __name__ == "__main__":
    build(Path(__file__).resolve().parent)
