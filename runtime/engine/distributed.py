"""Serving a compiled plan over several ranks: one process per rank, rank 0 in charge.

`serve_model(cfg)` serves in this process when the plan has one rank, else starts one process per
rank (`runtime/worker/launch.py`, gloo on CPU, NCCL on GPU). Rank 0 hosts the HTTP server, tokenizer and
scheduler; its runner, `DistRunner`, sends every step's batches to all ranks over a gloo control
group (`broadcast_object_list`), runs its own share, and collects the logits of the other
attention-DP ranks (`gather_object`). The other ranks loop in `follow()`: receive, run, send logits.

Life of one step under dp2ep2: the engine on rank 0 schedules DP rank 0 and DP rank 1 separately
(each has its own pages and req_to_token rows), builds two `ForwardBatch`es (an idle one for a rank
with nothing to do), and `DistRunner.forward_dp` broadcasts (phase, batches) with each batch's
req_to_token cut to its own rows. Every rank runs the same phase graph on its DP rank's batch with
`dp_tokens` = every DP rank's token count, so padding and collectives line up; rank 1 sends its
logits back for rank 0 to sample. A `None` message ends the loop.

Shutdown: SIGINT/SIGTERM to the launcher is passed on to the ranks; rank 0 stops serving
gracefully and sends `None`; the other ranks ignore the signals and exit when told to.
"""
from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import signal
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from glmc.runtime.worker.forward_batch import ForwardBatch
from glmc.runtime.worker.model_runner import ModelRunner, PlanRunner

# The control group waits as long as the server is idle; a rank that dies is noticed by the
# launcher (runtime/worker/launch.py), which stops the others.
CONTROL_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class ServeConfig:
    """Everything a rank needs to build its part of the server (picklable: sent to each rank)."""

    ckpt_dir: str
    plan_dir: str | None = None
    parallel: str | None = None
    model_name: str = "glmc"
    host: str = "127.0.0.1"
    port: int = 8000
    num_pages: int = 256
    max_context: int | None = None
    engine_kwargs: dict = field(default_factory=dict)
    warmup: bool = True
    log_level: str = "info"
    timeout_s: float = 600.0  # collectives of one step (and start-up) fail after this long


class DistRunner(ModelRunner):
    """Rank 0's `ModelRunner`: every step goes to all ranks; each DP rank's logits come back."""

    def __init__(self, local: PlanRunner, group):
        mesh = local.executor.mesh
        self.local, self.group = local, group
        self.num_dp, self.attn_tp = mesh["attn_dp"], mesh["attn_tp"]
        self.vocab_size, self.num_pages = local.vocab_size, local.num_pages
        self.max_context = local.max_context

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.forward_dp([batch])[0]

    def forward_dp(self, batches: list[ForwardBatch]) -> list[torch.Tensor]:
        phase = PlanRunner.phase_of(batches)
        _send(self.group, (phase, [compact(b) for b in batches]))
        logits = _run(self.local, phase, batches)
        if self.num_dp == 1:  # the lm_head all-gather left the full logits on every TP rank
            return [logits]
        got = [None] * dist.get_world_size()
        dist.gather_object(logits, got, dst=0, group=self.group)
        return [got[d * self.attn_tp] for d in range(self.num_dp)]

    def close(self) -> None:
        """Tell the other ranks to exit (call once, after the last step)."""
        _send(self.group, None)


def follow(local: PlanRunner, group) -> None:
    """A rank other than 0: run every step rank 0 sends, until it sends None."""
    first_of_dp = local.executor.comm.coords.of("attn_tp") == 0
    while (msg := _recv(group)) is not None:
        phase, batches = msg
        logits = _run(local, phase, batches)
        if len(batches) > 1:
            mine = logits.cpu() if first_of_dp else None  # gloo moves host objects
            dist.gather_object(mine, None, dst=0, group=group)


def compact(batch: ForwardBatch) -> ForwardBatch:
    """`batch` with req_to_token cut to its own rows and positions: what travels to other ranks."""
    if batch.batch_size == 0:
        return ForwardBatch.idle()
    width = int(batch.seq_lens.max())
    return dataclasses.replace(
        batch, req_pool_indices=torch.arange(batch.batch_size),
        req_to_token=batch.req_to_token[batch.req_pool_indices, :width].clone())


def _run(local: PlanRunner, phase: str, batches: list[ForwardBatch]) -> torch.Tensor:
    dp_rank = local.executor.comm.coords.of("attn_dp")
    dp_tokens = [b.num_tokens for b in batches] if len(batches) > 1 else None
    return local.run(phase, batches[dp_rank], dp_tokens)


def _send(group, msg) -> None:
    dist.broadcast_object_list([msg], src=0, group=group)


def _recv(group):
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def groups_used(graphs: dict) -> set:
    """The process groups (tuples of mesh axes, or "world") the plan's collectives run over."""
    out = set()
    for g in graphs.values():
        for op in g.ops:
            if (grp := op.attr("group")) is not None:
                out.add(grp if isinstance(grp, str) else tuple(grp))
    return out


# -- serving -----------------------------------------------------------------------------------


def serve_model(cfg: ServeConfig) -> None:
    """Serve in the foreground until SIGINT/SIGTERM: in this process for a one-rank plan, else one
    process per rank (then a failing rank raises `launch.RankFailed`)."""
    from glmc.runtime.engine.build import build_engine
    from glmc.runtime.serving.server import serve
    from glmc.runtime.worker.launch import spawn

    world = _world(cfg)
    if world == 1:
        engine = build_engine(cfg.ckpt_dir, cfg.plan_dir, cfg.parallel, num_pages=cfg.num_pages,
                              max_context=cfg.max_context, warmup=cfg.warmup, **cfg.engine_kwargs)
        serve(engine, cfg.model_name, cfg.host, cfg.port, cfg.log_level)
        return
    previous = {s: signal.signal(s, _pass_on) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        spawn(_rank_main, world, cfg, timeout_s=cfg.timeout_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _world(cfg: ServeConfig) -> int:
    if cfg.plan_dir is not None:
        import json
        from pathlib import Path
        return int(json.loads((Path(cfg.plan_dir) / "plan.json").read_text())["parallel"]["world"])
    from glmc.parallel import parse_parallel
    from glmc.spec import load_spec
    return parse_parallel(cfg.parallel or "tp1", load_spec(cfg.ckpt_dir).config).world


def _pass_on(signum, frame) -> None:
    """The launcher's handler: rank 0 shuts the server down, the other ranks ignore signals."""
    for p in multiprocessing.active_children():
        try:
            os.kill(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _rank_main(rank: int, world: int, cfg: ServeConfig) -> None:
    if "OMP_NUM_THREADS" not in os.environ:  # ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if rank:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        os.environ["TQDM_DISABLE"] = "1"  # rank 0 shows the progress; tqdm reads it on import
    from glmc.runtime.engine.build import plan_runner, plan_source, warm_up
    from glmc.runtime.engine.engine import Engine
    from glmc.runtime.engine.tokenizer import Tokenizer
    from glmc.runtime.serving.server import serve
    from glmc.runtime.worker.comm import Comm

    src = plan_source(cfg.ckpt_dir, cfg.plan_dir, cfg.parallel)
    comm = Comm(next(iter(src.graphs.values())).meta["mesh"], groups_used(src.graphs))
    group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)  # after Comm's, on all ranks
    local = plan_runner(src, cfg.num_pages, cfg.max_context, comm)
    if rank:
        follow(local, group)
        return
    runner = DistRunner(local, group)
    try:
        engine = Engine(runner, Tokenizer.from_dir(cfg.ckpt_dir), **cfg.engine_kwargs)
        if cfg.warmup:
            warm_up(engine)
        serve(engine, cfg.model_name, cfg.host, cfg.port, cfg.log_level)
    finally:
        runner.close()
