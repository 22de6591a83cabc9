"""Serve a plan over HTTP: in this process for one rank, else one process per rank.

`serve_model(cfg)` serves until SIGINT/SIGTERM. With several ranks (`runtime/worker/launch.py`,
gloo on CPU, NCCL on GPU) rank 0 hosts the HTTP server, tokenizer and engine over a
`DistRunner`, and the other ranks follow its steps (`runtime/engine/distributed.py`).

Shutdown: SIGINT/SIGTERM to the launcher is passed on to the ranks; rank 0 stops serving
gracefully and sends `None`; the other ranks ignore the signals and exit when told to.
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from glmc.runtime.engine.distributed import DistRunner, follow

from glmc.plan import Plan

# The control group waits as long as the server is idle; a rank that dies is noticed by the
# launcher (runtime/worker/launch.py), which stops the others.
CONTROL_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class ServeConfig:
    """Everything a rank needs to build its part of the server (picklable: sent to each rank)."""

    plan: Plan
    ckpt_dir: str
    device: str = "cpu"
    model_name: str = "glmc"
    host: str = "127.0.0.1"
    port: int = 8000
    num_pages: int = 256
    max_context: int | None = None
    engine_kwargs: dict = field(default_factory=dict)
    warmup: bool = True
    log_level: str = "info"
    timeout_s: float = 600.0  # collectives of one step (and start-up) fail after this long


def serve_model(cfg: ServeConfig) -> None:
    """Serve in the foreground until SIGINT/SIGTERM: in this process for a one-rank plan, else one
    process per rank (then a failing rank raises `launch.RankFailed`)."""
    from glmc.runtime.engine.startup import build_engine
    from glmc.runtime.serving.server import serve
    from glmc.runtime.worker.launch import from_env, launched_by_env, spawn

    world = cfg.plan.world
    if world > 1 and launched_by_env():   # torchrun started this process as one rank
        rank, got = from_env(timeout_s=cfg.timeout_s)
        if got != world:
            raise ValueError(f"{cfg.plan.parallel} runs {world} ranks; the launcher started {got}")
        try:
            _rank_main(rank, world, cfg)
        finally:
            dist.destroy_process_group()
        return
    if world == 1:
        engine = build_engine(cfg.plan, cfg.ckpt_dir, device=cfg.device, num_pages=cfg.num_pages,
                              max_context=cfg.max_context, warmup=cfg.warmup, **cfg.engine_kwargs)
        serve(engine, cfg.model_name, cfg.host, cfg.port, cfg.log_level)
        return
    previous = {s: signal.signal(s, _pass_on) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        spawn(_rank_main, world, cfg, timeout_s=cfg.timeout_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


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
    from glmc.runtime.engine.engine import Engine
    from glmc.runtime.engine.startup import warm_up
    from glmc.runtime.engine.tokenizer import Tokenizer
    from glmc.runtime.serving.server import serve
    from glmc.runtime.worker.comm import Comm
    from glmc.runtime.worker.loader import load_runner

    comm = Comm(cfg.plan.mesh, cfg.plan.groups)
    group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)  # after Comm's, on all ranks
    local = load_runner(cfg.plan, cfg.ckpt_dir, device=cfg.device, comm=comm,
                        num_pages=cfg.num_pages, max_context=cfg.max_context,
                        max_running=cfg.engine_kwargs.get("max_running", 32))
    if rank:
        try:
            follow(local, group)
        finally:
            local.close()
        return
    runner = DistRunner(local, group)
    try:
        engine = Engine(runner, Tokenizer.from_dir(cfg.ckpt_dir), **cfg.engine_kwargs)
        if cfg.warmup:
            warm_up(engine)
        serve(engine, cfg.model_name, cfg.host, cfg.port, cfg.log_level)
    finally:
        runner.close()
        local.close()
