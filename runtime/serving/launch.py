"""Serve a plan over HTTP: in this process for one rank, else one process per rank.

`serve_model(cfg)` serves until SIGINT/SIGTERM. With several ranks (`runtime/worker/launch.py`,
gloo on CPU, NCCL on GPU, or processes torchrun started) rank 0 hosts the HTTP server, tokenizer
and engine over a `DistRunner`, and the other ranks follow its steps
(`runtime/engine/distributed.py`).

Shutdown (`_StopRanks`): a terminal's Ctrl-C reaches every process of the group, so the ranks
leave SIGINT to the launcher (they are born ignoring it, then only exit on it if the launcher died:
torch's parent-death signal). The launcher's first SIGINT/SIGTERM sends SIGTERM to every
rank: rank 0, serving, shuts the server down gracefully (in-flight requests get
`ServerOptions.shutdown_timeout_s`, then are aborted) and sends `None`; the other ranks ignore
SIGTERM while they follow and exit when told to. A rank still starting up simply exits, and the
launcher stops the rest at once. A second signal kills every rank. Runners release their CUDA
graphs before the process group goes (NCCL teardown with captured work hangs).
"""
from __future__ import annotations

import datetime
import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from glmc.plan import Plan
from glmc.run_config import RunConfig
from glmc.runtime.engine.distributed import DistRunner, follow
from glmc.runtime.serving.server import ServerOptions

# The control group waits as long as the server is idle; a rank that dies is noticed by the
# launcher (runtime/worker/launch.py), which stops the others.
CONTROL_TIMEOUT = datetime.timedelta(days=365)


@dataclass
class ServeConfig:
    """Everything a rank needs to build its part of the server (picklable: sent to each rank)."""

    plan: Plan
    ckpt_dir: str
    run: RunConfig = field(default_factory=RunConfig)  # device, KV pool, scheduler, capture, warm-up
    model_name: str = "glmc"
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    timeout_s: float = 600.0  # collectives of one step (and start-up) fail after this long
    server: ServerOptions = field(default_factory=ServerOptions)  # body limit, shutdown grace


def serve_model(cfg: ServeConfig) -> None:
    """Serve in the foreground until SIGINT/SIGTERM: in this process for a one-rank plan, else one
    process per rank (then a failing rank raises `launch.RankFailed`). A signal during start-up
    raises KeyboardInterrupt once every rank is gone."""
    from glmc.runtime.engine.startup import build_engine
    from glmc.runtime.serving.http_process import serve
    from glmc.runtime.worker.launch import RankFailed, from_env, launched_by_env, spawn

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
        with _sigterm_interrupts():  # start-up ends with KeyboardInterrupt on either signal
            engine = build_engine(cfg.plan, cfg.ckpt_dir, cfg.run)
        serve(engine, cfg.model_name, cfg.host, cfg.port, cfg.log_level, cfg.server)
        return
    stop = _StopRanks()
    try:   # the ranks are born ignoring SIGINT; this process handles it throughout
        spawn(_rank_main, world, cfg, timeout_s=cfg.timeout_s, on_started=stop.started, ignore_sigint=True)
    except RankFailed:
        if not stop.requested:
            raise
        print(f"glmc: {stop.outcome()}", flush=True)
        if stop.during_start_up:
            raise KeyboardInterrupt from None
    finally:
        stop.uninstall()


@contextmanager
def _sigterm_interrupts():
    """SIGTERM raises KeyboardInterrupt inside the block, as SIGINT does (start-up is then left
    cleanly either way)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


class _StopRanks:
    """The launcher's SIGINT/SIGTERM handler (see the module docstring)."""

    FOLLOWER_GRACE_S = 5.0  # after rank 0 exits, the others get this long before SIGKILL

    def __init__(self):
        self.processes: list = []
        self.requested = 0
        self.previous = {s: signal.signal(s, self) for s in (signal.SIGINT, signal.SIGTERM)}

    def started(self, processes: list) -> None:
        """Every rank was started: from now on signals reach them (one that came while they were
        being started stops them now)."""
        self.processes = processes
        if self.requested:
            self._stop()

    def uninstall(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def __call__(self, signum, frame) -> None:
        self.requested += 1
        if not self.processes:  # a signal while the ranks are being started: `started` stops them
            return
        if self.requested == 1:
            self._stop()
        else:
            print("glmc: second signal: stopping every rank now", flush=True)
            self._signal_all(signal.SIGKILL)

    def _stop(self) -> None:
        self._signal_all(signal.SIGTERM)
        threading.Thread(target=self._reap_followers, daemon=True).start()

    def _signal_all(self, sig: int) -> None:
        for p in self.processes:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass

    def _reap_followers(self) -> None:
        """Ranks that follow rank 0 cannot finish without it: once it is gone, stop them (at once
        if it did not shut down cleanly, before the launcher's own clean-up reports them). Runs
        beside the launcher's join, so it only watches: it never reaps a rank."""
        rank0, followers = self.processes[0], self.processes[1:]
        clean = _exited_cleanly(rank0.pid)
        wait([p.sentinel for p in followers], self.FOLLOWER_GRACE_S if clean else 0.0)
        for p in followers:
            if not wait([p.sentinel], 0):
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    @property
    def during_start_up(self) -> bool:
        """Rank 0 died of the first SIGTERM: it came before the server took the signal over."""
        return self.requested == 1 and self.processes[0].exitcode == -signal.SIGTERM

    def outcome(self) -> str:
        if self.requested > 1:
            return "stopped every rank (forced)"
        return "interrupted during start-up; every rank stopped" if self.during_start_up \
            else "stopped every rank"


def _exited_cleanly(pid: int) -> bool:
    """Wait for process `pid` to exit; whether its status was 0. Leaves it for its parent's own
    wait (WNOWAIT); False if that wait came first and took the status."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:
        return False
    return info.si_code == os.CLD_EXITED and info.si_status == 0


def _exit_if_orphaned(launcher: int):
    """A rank's SIGINT handler: Ctrl-C is the launcher's to handle, but torch makes a rank's
    parent-death signal SIGINT too; a rank whose launcher is gone exits."""
    def handler(signum, frame):
        if os.getppid() != launcher:
            os._exit(1)
    return handler


def _rank_main(rank: int, world: int, cfg: ServeConfig) -> None:
    signal.signal(signal.SIGINT, _exit_if_orphaned(os.getppid()))  # ignored until now
    if "OMP_NUM_THREADS" not in os.environ:  # ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if rank:  # until it follows, SIGTERM ends a rank at once
        os.environ["TQDM_DISABLE"] = "1"  # rank 0 shows the progress; tqdm reads it on import
    from glmc.runtime.engine.engine import Engine
    from glmc.runtime.engine.startup import warm_up
    from glmc.runtime.engine.tokenizer import Tokenizer
    from glmc.runtime.serving.http_process import serve
    from glmc.runtime.worker.comm import Comm
    from glmc.runtime.worker.loader import load_runner

    comm = Comm(cfg.plan.mesh, cfg.plan.groups)
    group = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)  # after Comm's, on all ranks
    # several ranks capture the decode graphs only: their MTP and prefill steps run eagerly
    local = load_runner(cfg.plan, cfg.ckpt_dir, replace(cfg.run, speculative_num_steps=0), comm=comm)
    if rank:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # from now on, rank 0 says when to stop
        try:
            follow(local, group)
        finally:
            local.close()
        return
    runner = DistRunner(local, group)
    try:
        engine = Engine(runner, Tokenizer.from_dir(cfg.ckpt_dir), cfg.run)
        if cfg.run.warmup:
            warm_up(engine)
        serve(engine, cfg.model_name, cfg.host, cfg.port, cfg.log_level, cfg.server,
              signals=(signal.SIGTERM,))
    finally:
        runner.close()
        local.close()
