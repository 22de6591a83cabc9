"""The Python API: compile a model, load this rank's weights, run prefill / decode on token ids.

    from glmc.api import load
    m = load("path/to/hf_checkpoint")               # compiles for tp1 on the torch target
    logits = m.prefill([[1, 2, 3], [4, 5]])           # [2, vocab]: each request's last position
    logits = m.decode([7, 8])                         # one new token per request -> [2, vocab]
    m.generate_greedy([[1, 2, 3]], 8)                 # -> [[8 token ids]]

Requests get fixed KV rows (row r owns pages r*pages_per_request+1 ...); the pool's last page is
the executor's scratch page. Under a multi-rank spec, call `load` in every rank's process (see
`glmc.runtime.worker.launch.spawn`); `dp_tokens` then lists every DP rank's token count.

`plan_for(ckpt_dir, plan_dir, parallel, run)` gives the `glmc.plan.Plan` to serve a checkpoint
with (a plan directory checked against the checkpoint, or the checkpoint's model compiled now);
`build_engine(ckpt_dir, ...)` starts a one-process serving engine over it (what `glmc run` does
for one rank). `run` is the `glmc.run_config.RunConfig` (device, KV pages, scheduler limits, ...);
both also take its fields as keywords (`build_engine(ckpt, max_running=4)`). Both compile on demand; the runtime itself only ever receives a Plan.
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from pathlib import Path

import torch

from glmc.compiler import compile_plan
from glmc.config import GlmConfig, Options
from glmc.parallel import parse_parallel
from glmc.plan import Plan
from glmc.run_config import RunConfig, with_settings
from glmc.runtime.worker.executor import PlanExecutor
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.kv_cache import PAGE_SIZE
from glmc.runtime.worker.loader import load_runner, progress
from glmc.spec import kv_dtyped, load_spec, quantized


@dataclass
class Model:
    """A compiled plan bound to this rank's weights and a KV pool, with simple request rows."""
    executor: PlanExecutor
    spec: object
    max_requests: int
    pages_per_request: int
    seqs: list = field(default_factory=list)

    @property
    def req_to_token(self) -> torch.Tensor:
        pages = torch.arange(self.max_requests * self.pages_per_request).view(
            self.max_requests, self.pages_per_request) + 1
        return (pages[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(self.max_requests, -1)

    def prefill(self, prompts: list[list[int]], dp_tokens=None) -> torch.Tensor:
        """Start new requests (replacing any earlier ones); logits of each prompt's last token."""
        if len(prompts) > self.max_requests:
            raise ValueError(f"{len(prompts)} prompts, max_requests is {self.max_requests}")
        self.seqs = [list(p) for p in prompts]
        batch = ForwardBatch.build("extend", prompts, list(range(len(prompts))), [0] * len(prompts),
                                   self.req_to_token) if prompts else ForwardBatch.idle(self.req_to_token)
        return self.executor.forward("prefill", batch, dp_tokens=dp_tokens)["logits"]

    def decode(self, tokens: list[int], dp_tokens=None) -> torch.Tensor:
        """Append one token to every running request; logits for the next one."""
        if len(tokens) != len(self.seqs):
            raise ValueError(f"{len(tokens)} tokens for {len(self.seqs)} running requests")
        for s, t in zip(self.seqs, tokens):
            s.append(t)
        if not self.seqs:
            return self.executor.forward("decode", ForwardBatch.idle(self.req_to_token),
                                         dp_tokens=dp_tokens)["logits"]
        batch = ForwardBatch.build("decode", [[s[-1]] for s in self.seqs], list(range(len(self.seqs))),
                                   [len(s) - 1 for s in self.seqs], self.req_to_token)
        return self.executor.forward("decode", batch, dp_tokens=dp_tokens)["logits"]

    def generate_greedy(self, prompts: list[list[int]], steps: int) -> list[list[int]]:
        out = [[] for _ in prompts]
        logits = self.prefill(prompts)
        for i in range(steps):
            nxt = logits.argmax(-1).tolist()
            for o, t in zip(out, nxt):
                o.append(t)
            if i + 1 < steps:
                logits = self.decode(nxt)
        return out


def load(ckpt_dir, parallel: str = "tp1", moe_a2a=None, max_requests: int = 8,
         pages_per_request: int = 2) -> Model:
    """Compile the checkpoint's model for `parallel` (torch target) and load this rank's shard."""
    spec = load_spec(ckpt_dir)
    plan = compile_plan(spec, parse_parallel(parallel, spec.config),
                        Options(device="cpu", moe_a2a=moe_a2a))
    runner = load_runner(plan, ckpt_dir, num_pages=max_requests * pages_per_request + 1)
    return Model(runner.executor, spec, max_requests, pages_per_request)


def plan_for(ckpt_dir, plan_dir=None, parallel: str | None = None, run: RunConfig | None = None,
             **settings) -> Plan:
    """The plan in `plan_dir` (checked against the checkpoint's config.json), or the checkpoint's
    model compiled now for `parallel` (default tp1) and the settings of `run` (`RunConfig`, or its
    fields as keywords): `device`'s target (cuda: CUDA-graph buckets up to `max_running`, the
    scheduler's largest decode batch), `quantize` ("fp8": the linear weights block-FP8, quantised
    on load where the checkpoint holds them unquantised), `kv_dtype` ("fp8", "bf16";
    `spec.kv_dtyped`: the KV and indexer caches' dtype) and `speculative_num_steps` (N > 0: the MTP
    verify graphs are bucketed for N + 1 tokens per request)."""
    run = with_settings(run, **settings)
    device, quantize, kv_dtype = run.device, run.quantize, run.kv_dtype
    spec = kv_dtyped(quantized(load_spec(ckpt_dir), quantize), kv_dtype)
    if plan_dir is None:
        par = parse_parallel(parallel or "tp1", spec.config)
        opts = Options(device=device) if device == "cpu" else Options(device=device,
                                                                      max_batch=run.max_running)
        if run.speculative_num_steps:
            opts = dataclasses.replace(opts, mtp_draft_tokens=run.speculative_num_steps + 1)
        with progress(total=1, desc=f"compiling {par.name} ({device})", unit="plan") as bar:
            plan = compile_plan(spec, par, opts)
            bar.update()
        return plan
    plan = Plan.load(plan_dir)
    differ = [k for k in GlmConfig.model_fields
              if getattr(plan.config, k) != getattr(spec.config, k)]
    if differ:
        k = differ[0]
        raise ValueError(f"{plan_dir} was compiled for another model than {ckpt_dir}: {k} = "
                         f"{getattr(plan.config, k)!r} in the plan, {getattr(spec.config, k)!r} in "
                         f"config.json ({len(differ)} fields differ)")
    if parallel is not None and parallel != plan.parallel:
        raise ValueError(f"{plan_dir} is compiled for {plan.parallel}, not {parallel}; drop "
                         f"--parallel or compile for {parallel}")
    if quantize is not None and plan.dtypes.weight != quantize:
        raise ValueError(f"{plan_dir} is compiled with {plan.dtypes.weight} weights, not {quantize}; "
                         f"compile with `glmc compile --quantize {quantize}`")
    if kv_dtype is not None and plan.dtypes.kv_cache != spec.dtypes.kv_cache:
        raise ValueError(f"{plan_dir} is compiled with a {plan.dtypes.kv_cache} KV cache, not {kv_dtype}; "
                         f"compile with `glmc compile --kv-dtype {kv_dtype}`")
    if plan.target != device:
        raise ValueError(f"{plan_dir} is compiled for device {plan.target!r}, not {device!r}; "
                         f"compile with `glmc compile --device {device}`")
    return plan


def build_engine(ckpt_dir, plan_dir=None, parallel: str | None = None, run: RunConfig | None = None, *,
                 runner: str = "plan", **settings):
    """A one-process serving engine (`glmc.runtime.engine.startup.build_engine`) over
    `plan_for(ckpt_dir, plan_dir, parallel, run)`, with the settings of `run` (`RunConfig`, or its
    fields as keywords)."""
    from glmc.runtime.engine.startup import build_engine as start

    run = with_settings(run, **settings)
    return start(plan_for(ckpt_dir, plan_dir, parallel, run), Path(ckpt_dir), run, runner=runner)
