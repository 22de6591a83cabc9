"""Start one process per rank with a torch.distributed group (gloo on CPU, NCCL on GPU).

`spawn(fn, world, *args)` runs `fn(rank, world, *args)` in `world` processes. If any rank raises
or dies, the others are stopped (after JOIN_GRACE_S: SIGTERM, then SIGKILL) and `RankFailed`
names the rank; collectives also time out after `timeout_s` (so a peer that vanished under
torchrun fails them instead of hanging). `on_started(processes)` (rank order) runs here once all
ranks started, e.g. to install signal handlers that talk to them.
Under `torchrun --nproc-per-node N` (or any launcher that sets RANK / WORLD_SIZE / MASTER_ADDR),
`from_env()` joins the group through env:// instead, so the same code runs on several nodes.
With NCCL each process takes the GPU of its local rank (LOCAL_RANK, else rank % GPUs).
"""
from __future__ import annotations

import datetime
import multiprocessing.util as mp_util
import os
import signal
import tempfile
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

JOIN_GRACE_S = 2.0


class RankFailed(RuntimeError):
    """A rank raised or died; the message names it and what it said."""


def _use_local_gpu(backend: str, rank: int) -> None:
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local)


def launched_by_env() -> bool:
    """Whether a launcher (torchrun) made this process one rank of a group."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def from_env(backend: str | None = None, timeout_s: float = 120.0) -> tuple[int, int]:
    """Join the process group a launcher set up (env://); -> (rank, world)."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _use_local_gpu(backend, rank)
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world


def _entry(rank, fn, world, init_file, backend, timeout_s, args):
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})   # blocked since the fork (`_born_ignoring_sigint`)
    _use_local_gpu(backend, rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
    finally:
        if backend == "nccl":
            torch.cuda.synchronize()
        dist.destroy_process_group()


@contextmanager
def _born_ignoring_sigint():
    """While active, each process multiprocessing spawns is forked with SIGINT ignored (an ignored
    disposition survives exec), and this process keeps its own SIGINT handler: ignored only around
    the fork itself, and blocked there too, so that a Ctrl-C landing in the fork stays pending
    (Linux never discards a blocked signal, ignored or not) and reaches the handler once it is
    back. The child inherits the mask too: `_entry` unblocks SIGINT (still ignored) first thing."""
    launch = mp_util.spawnv_passfds

    def spawnv_passfds(path, args, passfds):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return launch(path, args, passfds)
        finally:
            signal.signal(signal.SIGINT, previous)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    mp_util.spawnv_passfds = spawnv_passfds
    try:
        yield
    finally:
        mp_util.spawnv_passfds = launch


def spawn(fn, world: int, *args, backend: str | None = None, timeout_s: float = 120.0,
          on_started=None, ignore_sigint: bool = False) -> None:
    """`ignore_sigint`: the ranks are born ignoring SIGINT (`_born_ignoring_sigint`), for a
    launcher that handles a terminal's Ctrl-C for them."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    fd, init_file = tempfile.mkstemp(prefix="glmc-dist-")
    os.close(fd)
    os.unlink(init_file)
    try:
        with _born_ignoring_sigint() if ignore_sigint else nullcontext():
            ctx = mp.start_processes(_entry, args=(fn, world, init_file, backend, timeout_s, args),
                                     nprocs=world, join=False, start_method="spawn")
        if on_started is not None:
            on_started(ctx.processes)
        while not ctx.join(grace_period=JOIN_GRACE_S):
            pass
    except mp.ProcessRaisedException as e:
        raise RankFailed(f"a rank raised: {str(e).strip().splitlines()[-1]}\n{e}") from None
    except mp.ProcessExitedException as e:
        raise RankFailed(f"rank {e.error_index} died (exit code {e.exit_code}); the other ranks "
                         "were stopped") from None
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)
