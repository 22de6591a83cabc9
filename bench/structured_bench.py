"""Structured outputs' costs: the grammar engines on glmc-small's tokenizer, and the mask's time per decode step.

    python -m bench.structured_bench [--out FILE] [--engines llguidance,xgrammar] [--batches 1,32]
    python -m bench.structured_bench --tiny      # dry run: 5 tokens, batch 1, one round

One JSON line per row on stdout; --out gets them all with the device, date, commit and the host's
load average before and after (other work on a shared host shows there). Times are wall clock;
the grammar engines run on one thread, the engine rows on torch's threads (--threads N to set them:
on a host shared with other work, 1 keeps torch's threads from waiting on each other).
1. Per grammar engine (llguidance, glmc's; xgrammar where it imports: never a glmc dependency, a
   row says so where it does not), over glmc-small's tokenizer (models/small, 4096 tokens):
   - `import`: `import ENGINE` in a fresh interpreter, s (median of 3);
   - `tokenizer`: the engine's view of the tokenizer, made once per process, ms;
   - `compile`: a grammar compiled and its matcher made, caches off, ms, per schema: `person`
     (tests/test_structured_outputs.py's: nested object, enum, integer range, array, required) and
     `json_object` (`{"type": "object"}`, what response_format json_object asks for);
   - `walk`: per token, the mask of the allowed tokens filled (`mask_us`) and the token accepted
     (`accept_us`), over the same random walk of --tokens tokens through valid documents (drawn
     uniformly among the allowed tokens with llguidance; each engine replays it, `refused` counts
     the documents it cut short at a token it would not accept), compact JSON.
2. Per batch size, on glmc-small's engine as `glmc run` builds it (overlap on, warmed up; the CPU
   torch target, or the CUDA target where a GPU is):
   - `mask_cost`: the mask's own work per step, as the engine does it: `token_bitmask` over every
     request (`fill_ms`), the bitmask unpacked and applied to the logits as `bias_and_penalties`
     does (`apply_ms`), `GrammarState.advance` per request (`advance_ms`); medians over --tokens
     steps, every request on its own random walk, for the person schema and the text grammar below;
   - `engine_step`: median wall ms of `engine.step()` in steady decode with a grammar on every
     request (`TEXT`: text that never ends, so every step is constrained) and without, --rounds
     rounds of --steps steps each, alternating, the median of the rounds' medians; `added_ms` is
     their difference.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import ROOT

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "maxLength": 8}},
        "required": ["city", "zip"], "additionalProperties": False},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False}
SCHEMAS = {"person": PERSON, "json_object": {"type": "object"}}
# Text ended only by a control byte the model never writes: every step of a request is constrained.
TEXT = 'start: /[^\\x01]*/ "\\x01"'
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
MAX_DOC_TOKENS = 300   # a walk through json_object (unbounded) is cut into documents this long


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def stats_us(seconds: list[float]) -> dict:
    s = sorted(seconds)
    return {"median": s[len(s) // 2] * 1e6, "p90": s[int(0.9 * (len(s) - 1))] * 1e6,
            "mean": sum(s) / len(s) * 1e6}


def import_s(module: str, repeats: int = 3) -> float:
    """Seconds of `import module` in a fresh interpreter (this one's, this environment)."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    return statistics.median(float(subprocess.run([sys.executable, "-c", code], check=True, text=True,
                                                  capture_output=True).stdout) for _ in range(repeats))


# ----------------------------------------------------------------------------- the engines
class Llguidance:
    """glmc's engine, used as runtime/engine/grammar.py uses it (compact JSON, masks by pointer)."""
    name = module = "llguidance"

    def __init__(self, tok, vocab_size: int):
        import llguidance
        self.ll, self.tok, self.vocab_size = llguidance, tok, vocab_size
        self.tokenizer = self.make_tokenizer()

    def make_tokenizer(self):
        return self.ll.LLTokenizer(self.tok.tok.to_str(), n_vocab=self.vocab_size,
                                   eos_token=sorted(self.tok.eos_token_ids))

    def matcher(self, schema: dict):
        from glmc.runtime.engine.grammar import json_schema_grammar
        return self.ll.LLMatcher(self.tokenizer, json_schema_grammar(schema), log_level=0)

    def new_mask(self):
        import torch
        return torch.full((1, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill(self, m, mask) -> None:
        m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.shape[1] * 4)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()


class Xgrammar(Llguidance):
    """xgrammar with the same language: compact separators, no strict mode (a schema's own
    additionalProperties decide), the same eos ids; its tokenizer view through transformers."""
    name = module = "xgrammar"

    def __init__(self, tok, vocab_size: int):
        import xgrammar
        self.xgr, self.tok, self.vocab_size = xgrammar, tok, vocab_size
        self.tokenizer = self.make_tokenizer()
        self.compiler = xgrammar.GrammarCompiler(self.tokenizer, max_threads=1, cache_enabled=False)

    def make_tokenizer(self):
        from transformers import PreTrainedTokenizerFast
        hf = PreTrainedTokenizerFast(tokenizer_object=self.tok.tok)
        return self.xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                       stop_token_ids=sorted(self.tok.eos_token_ids))

    def matcher(self, schema: dict):
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                     separators=(",", ":"), strict_mode=False)
        return self.xgr.GrammarMatcher(compiled)

    def new_mask(self):
        return self.xgr.allocate_token_bitmask(1, self.vocab_size)

    def fill(self, m, mask) -> None:
        m.fill_next_token_bitmask(mask, 0)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


ENGINES = {"llguidance": Llguidance, "xgrammar": Xgrammar}


def version(module: str) -> str:
    from importlib.metadata import version as dist_version
    return dist_version(module)


def allowed(mask_row) -> list[int]:
    """The token ids whose bits are set in one bitmask row ([words] int32)."""
    import numpy as np
    return np.flatnonzero(np.unpackbits(mask_row.numpy().view(np.uint8), bitorder="little")).tolist()


def random_walk(engine: Llguidance, schema: dict, num_tokens: int, seed: int = 0) -> list[list[int]]:
    """Documents valid for `schema`, tokens drawn uniformly among those the mask allows, until
    `num_tokens` tokens in all (a document is cut at MAX_DOC_TOKENS)."""
    import random
    rng, docs, total = random.Random(seed), [], 0
    while total < num_tokens:
        m, mask, doc = engine.matcher(schema), engine.new_mask(), []
        while not engine.done(m) and len(doc) < MAX_DOC_TOKENS and total + len(doc) < num_tokens:
            engine.fill(m, mask)
            doc.append(rng.choice(allowed(mask[0])))
            engine.accept(m, doc[-1])
        docs.append(doc)
        total += len(doc)
    return docs


def replay(engine: Llguidance, schema: dict, docs: list[list[int]]) -> dict:
    """Per token: mask fill and accept times (us) along `docs`; tokens the engine refused."""
    fills, accepts, refused = [], [], 0
    for doc in docs:
        m, mask = engine.matcher(schema), engine.new_mask()
        for token in doc:
            t = time.perf_counter()
            engine.fill(m, mask)
            t1 = time.perf_counter()
            ok = engine.accept(m, token)
            fills.append(t1 - t)
            accepts.append(time.perf_counter() - t1)
            if not ok:
                refused += 1
                break
    return {"tokens": len(fills), "refused": refused, "mask_us": stats_us(fills),
            "accept_us": stats_us(accepts)}


def engine_rows(names: list[str], tok, vocab_size: int, num_tokens: int, repeats: int):
    """Part 1's rows, one engine after the other (a generator)."""
    walks = {}
    for name in names:
        try:
            importlib.import_module(ENGINES[name].module)
        except ImportError as e:
            yield {"bench": "engine", "engine": name, "error": f"not importable, skipped: {e}"}
            continue
        engine = ENGINES[name](tok, vocab_size)
        base = {"bench": "engine", "engine": name, "version": version(name)}
        yield {**base, "what": "import", "s": import_s(engine.module)}
        yield {**base, "what": "tokenizer", "ms": median_ms(engine.make_tokenizer, repeats=3)}
        for schema_name, schema in SCHEMAS.items():
            if schema_name not in walks:   # drawn with glmc's engine, replayed by every engine
                walks[schema_name] = random_walk(Llguidance(tok, vocab_size), schema, num_tokens)
            yield {**base, "what": "compile", "schema": schema_name,
                   "ms": median_ms(lambda: engine.matcher(schema), repeats)}
            yield {**base, "what": "walk", "schema": schema_name, **replay(engine, schema, walks[schema_name])}


# ----------------------------------------------------------------------------- the engine's step
class Row:
    """What `grammar.token_bitmask` reads of a request: its state and its output so far."""

    def __init__(self, state):
        self.grammar_state, self.output_ids = state, []


def mask_cost(grammar: str, ltok, batch: int, steps: int, vocab_size: int, dev: str = "cpu",
              seed: int = 0) -> dict:
    """Median ms per step of the mask's three parts for `batch` requests walking `grammar` (each
    draws a random allowed token per step; a request whose grammar ends starts again, untimed);
    on a GPU, apply includes the bitmask's upload and waits for the device."""
    import random

    import torch
    from glmc.runtime.engine.grammar import GrammarState, allowed_tokens, token_bitmask
    from glmc.runtime.worker.forward_batch import to_device
    rng = random.Random(seed)
    rows = [Row(GrammarState(grammar, ltok)) for _ in range(batch)]
    logits = torch.randn(batch, vocab_size, device=dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    fill, apply, advance = [], [], []
    for _ in range(steps):
        t = time.perf_counter()
        mask = token_bitmask(rows)
        t1 = time.perf_counter()
        logits.masked_fill_(~allowed_tokens(to_device(mask, dev), vocab_size), float("-inf"))
        sync()
        t2 = time.perf_counter()
        tokens = [rng.choice(allowed(mask[i])) for i in range(batch)]
        t3 = time.perf_counter()
        ended = [r.grammar_state.advance(token) for r, token in zip(rows, tokens)]
        t4 = time.perf_counter()
        for r, token in zip(rows, tokens):
            r.output_ids.append(token)   # consumed by its state: no tokens ahead of it
        fill.append(t1 - t), apply.append(t2 - t1), advance.append(t4 - t3)
        rows = [Row(GrammarState(grammar, ltok)) if e else r for r, e in zip(rows, ended)]
    med = {k: statistics.median(v) * 1e3 for k, v in (("fill_ms", fill), ("apply_ms", apply),
                                                      ("advance_ms", advance))}
    return {**med, "total_ms": sum(med.values())}


def steady_steps(engine, prompt: list[int], batch: int, grammar: str | None, steps: int, warm: int = 3
                 ) -> list[float]:
    """Wall ms of `steps` engine steps once `batch` requests are all decoding (then aborted)."""
    from glmc.runtime.engine.sampling import SamplingParams
    reqs = [engine.make_request(prompt, SamplingParams(
        max_tokens=steps + warm + 8, temperature=1.0, seed=i, ignore_eos=True, grammar=grammar))
        for i in range(batch)]
    for r in reqs:
        engine.submit(r)
    while min(len(r.output_ids) for r in reqs) < warm:
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t) * 1e3)
    if any(r.finished for r in reqs):
        raise RuntimeError(f"a request ended within the timed steps: {[r.finish_reason for r in reqs]}")
    for r in reqs:
        engine.abort(r.rid)
    while engine.step():
        pass
    return times


def step_rows(batches: list[int], steps: int, rounds: int, mask_steps: int):
    """Part 2's rows, per batch size (a generator)."""
    from glmc.api import build_engine
    from glmc.runtime.engine.grammar import json_schema_grammar, lark_grammar, ll_tokenizer
    from glmc.tiny import SMALL_DIR
    import torch
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    engine = build_engine(SMALL_DIR, device=dev, max_running=max(32, *batches))
    tok, vocab_size = engine.tokenizer, engine.runner.vocab_size
    ltok, text = ll_tokenizer(tok, vocab_size), lark_grammar(TEXT)
    prompt = tok.encode_chat(tok.render_chat(ASK))
    for batch in batches:
        for name, grammar in (("person", json_schema_grammar(PERSON)), ("text", text)):
            yield {"bench": "mask_cost", "batch": batch, "grammar": name, "steps": mask_steps,
                   "device": dev, **mask_cost(grammar, ltok, batch, mask_steps, vocab_size, dev)}
        runs = {"plain": [], "text": []}
        for _ in range(rounds):
            for mode in runs:
                runs[mode].append(steady_steps(engine, prompt, batch, text if mode == "text" else None, steps))
        # the median of the rounds' medians: a round that other work on the host slowed counts once
        rounds_ms = {m: [statistics.median(r) for r in rs] for m, rs in runs.items()}
        med = {m: statistics.median(r) for m, r in rounds_ms.items()}
        yield {"bench": "engine_step", "batch": batch, "steps": steps, "rounds": rounds,
               "device": dev, "overlap": engine.overlap, "plain_ms": med["plain"], "grammar_ms": med["text"],
               "added_ms": med["text"] - med["plain"],
               "added_pct": 100 * (med["text"] - med["plain"]) / med["plain"],
               "round_medians_ms": rounds_ms}


# ----------------------------------------------------------------------------- the run
def device() -> str:
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    return platform.processor() or platform.machine()


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, text=True,
                              capture_output=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("GLMC_COMMIT", "unknown")


def run(engines: list[str], batches: list[int], num_tokens: int, steps: int, rounds: int,
        repeats: int, emit=print) -> list[dict]:
    """Every row of both parts, each passed to `emit` as soon as it is measured."""
    import torch
    from glmc.runtime.engine.tokenizer import Tokenizer
    from glmc.tiny import SMALL_DIR
    tok = Tokenizer.from_dir(SMALL_DIR)
    vocab_size = json.loads((SMALL_DIR / "config.json").read_text())["vocab_size"]
    unknown = sorted(set(engines) - ENGINES.keys())
    if unknown:
        raise ValueError(f"unknown engine {unknown[0]!r} (known: {', '.join(ENGINES)})")
    rows, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)   # the grammar engines: one thread, as the engine's loop calls them
    try:
        for row in engine_rows(engines, tok, vocab_size, num_tokens, repeats):
            rows.append(row), emit(json.dumps(row))
    finally:
        torch.set_num_threads(threads)
    for row in step_rows(batches, steps, rounds, num_tokens) if batches else ():
        rows.append(row), emit(json.dumps(row))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--engines", default="llguidance,xgrammar")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--tokens", type=int, default=2000, help="tokens per walk")
    ap.add_argument("--steps", type=int, default=40, help="timed engine steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20, help="compiles timed per schema")
    ap.add_argument("--threads", type=int, help="torch threads of the engine rows (default: torch's)")
    ap.add_argument("--tiny", action="store_true", help="dry run: 5 tokens, batch 1, one round")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",") if b]
    if a.tiny:
        a.tokens, a.steps, a.rounds, a.repeats, batches = 5, 5, 1, 2, [1]
    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    head = {"device": device(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit(),
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "tokens": a.tokens, "steps": a.steps,
            "rounds": a.rounds, "repeats": a.repeats, "load_before": os.getloadavg()[0]}
    print(json.dumps(head), flush=True)
    rows = run([e for e in a.engines.split(",") if e], batches, a.tokens, a.steps, a.rounds, a.repeats,
               emit=lambda line: print(line, flush=True))
    head["load_after"] = os.getloadavg()[0]   # 1-minute load average: other work on the host shows
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({**head, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
