"""The ranks of a tensor-parallel run: starting them, their process groups, stopping them.

A run over N ranks has one process per rank (one GPU each on CUDA: rank r on cuda:r, or on
cuda:LOCAL_RANK under torchrun) and two process groups: the default one, over which the
model's collectives run (models/tensor_parallel.py; NCCL on CUDA, gloo on the CPU), and
`Ranks.control`, a gloo group over which rank 0 sends the other ranks what to run
(runtime/replicated.py). The control group waits without a time limit, since an engine may
idle between requests for as long as it likes.

Two ways to get there:
- `spawn_ranks`: this process is rank 0 and starts ranks 1..N-1 itself (torch.multiprocessing,
  spawn context, daemon processes), meeting them through a TCP store on a free local port.
  Each started rank runs `entry(ranks, *args)` and exits when it returns, at once (its
  error logged) when it raises, or at once when this process disappears
  (`_exit_with_parent`); it logs at this process's root level, each line marked with its
  rank, and prints every thread's Python stack on SIGUSR1 (a rank that seems stuck says
  where). `Ranks.close` joins them, terminating those that do not end in time. A started
  rank that exits while the ranks are open is logged as an error at once
  (`_watch_workers`): rank 0 may then wait in a collective that will never complete, and the
  log says why.
- `join_ranks`: every rank was started by a launcher (`torchrun`: RANK, WORLD_SIZE,
  MASTER_ADDR, MASTER_PORT in the environment) or the default group is initialised already;
  this process is one of them and uses that group.

On CUDA every rank sets NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 where unset
(NVLink multicast stays off) before its NCCL group starts. On the CPU each rank takes an
equal share of the cores for its intra-op threads: the ranks' collectives wait on each other,
and oversubscribed cores make every wait as long as a scheduler time slice.
"""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..models.tensor_parallel import Sharding

logger = logging.getLogger(__name__)

# NVLink multicast (NVLS, symmetric memory) stays off unless the environment says otherwise.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# The control group waits for rank 0's next command however long the engine idles.
CONTROL_TIMEOUT = datetime.timedelta(days=365)
# How long ranks may take to start (import torch, connect) before rank 0 gives up.
START_TIMEOUT = datetime.timedelta(minutes=5)
# How long `Ranks.close` waits for a started rank to exit before terminating it.
JOIN_SECONDS = 30.0
# How often rank 0 checks that the ranks it started are alive.
WATCH_SECONDS = 1.0
HOST = "127.0.0.1"
_READY_KEY = "specrun/ready/{rank}"


@dataclass
class Ranks:
    """This process's place among the ranks of one tensor-parallel run.

    rank, world_size: as in the default process group.
    device: this rank's device (cuda:r, or the CPU).
    control: the gloo group rank 0 sends commands over.
    workers: the processes this one started (rank 0 of `spawn_ranks`; else empty).
    owns_group: whether the default group was initialised here (and is destroyed by `close`).
    """

    rank: int
    world_size: int
    device: torch.device
    control: dist.ProcessGroup
    workers: list[BaseProcess] = field(default_factory=list)
    owns_group: bool = True
    _threads: int | None = None
    _closed: bool = False
    _stop_watching: threading.Event = field(default_factory=threading.Event)

    @property
    def sharding(self) -> Sharding:
        """This rank's block of the model (the default group)."""
        return Sharding(self.rank, self.world_size)

    def close(self, *, timeout: float = JOIN_SECONDS) -> None:
        """Leave the process groups, then wait for the started ranks to exit (they do once
        rank 0 has sent its last command and left), terminating those still running after
        `timeout` seconds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_watching.set()
        # Groups first: NCCL's teardown waits for every rank's, the started ones' included.
        if dist.is_initialized():
            if self.owns_group:
                dist.destroy_process_group()
            else:
                dist.destroy_process_group(self.control)
        if self._threads is not None:
            torch.set_num_threads(self._threads)
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                logger.warning("rank process %s did not exit; terminating it", worker.name)
                worker.terminate()
                worker.join(5.0)


def launched_by_torchrun() -> bool:
    """Whether this process is one of several ranks a launcher started (or whose default
    process group is already initialised): then `join_ranks`, not `spawn_ranks`."""
    return dist.is_initialized() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def backend_for(device_type: str) -> str:
    """The model group's backend: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def spawn_ranks(
    world_size: int,
    *,
    device_type: str,
    entry: Callable[..., None],
    args: tuple = (),
) -> Ranks:
    """Become rank 0 of `world_size` ranks, starting ranks 1..world_size-1 as daemon processes
    that each run `entry(their Ranks, *args)` (importable and picklable, as `args` are). Raises
    RuntimeError naming a rank that exits before it joins."""
    store = dist.TCPStore(
        HOST, 0, world_size, is_master=True, wait_for_workers=False, timeout=START_TIMEOUT
    )
    context = mp.get_context("spawn")
    # Started ranks log at this process's level.
    common = (world_size, store.port, device_type, os.getpid(), logging.getLogger().level, entry)
    workers = []
    try:
        for rank in range(1, world_size):
            worker = context.Process(
                target=_rank_main,
                args=(rank, *common, args),
                name=f"specrun-rank{rank}",
                daemon=True,
            )
            worker.start()
            workers.append(worker)
        _wait_until_ready(store, workers)
        ranks = _init(0, world_size, device_type, local_rank=0, store=store)
    except BaseException:
        for worker in workers:
            worker.terminate()
            worker.join(5.0)
        raise
    ranks.workers = workers
    threading.Thread(
        target=_watch_workers,
        args=(workers, ranks._stop_watching),
        name="specrun-rank-watch",
        daemon=True,
    ).start()
    return ranks


def join_ranks(world_size: int, *, device_type: str) -> Ranks:
    """Become one of the ranks a launcher started (torchrun's environment), initialising the
    default group from the environment unless it is already; its size must be `world_size`
    (ValueError saying how to launch)."""
    initialised = dist.is_initialized()
    found = dist.get_world_size() if initialised else int(os.environ["WORLD_SIZE"])
    if found != world_size:
        raise ValueError(
            f"this process is one of {found} ranks (WORLD_SIZE / the default process group) "
            f"but EngineConfig(tensor_parallel={world_size}); launch {world_size} processes "
            f"(torchrun --nproc-per-node {world_size}) or set tensor_parallel={found}"
        )
    rank = dist.get_rank() if initialised else int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return _init(
        rank, world_size, device_type, local_rank=local_rank, store=None, owns_group=not initialised
    )


def _init(
    rank: int,
    world_size: int,
    device_type: str,
    *,
    local_rank: int,
    store: dist.Store | None,
    owns_group: bool = True,
) -> Ranks:
    """Initialise the default group (unless not `owns_group`: it is already) and the control
    group; on CUDA this rank runs on cuda:`local_rank`."""
    device = torch.device("cpu")
    threads = None
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        for name, value in NCCL_ENV.items():
            os.environ.setdefault(name, value)
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if owns_group:
        options = {} if store is None else {"store": store, "rank": rank, "world_size": world_size}
        dist.init_process_group(backend_for(device_type), **options)
    if device_type == "cuda":
        # NCCL starts its communicator at the first collective: here, not inside a capture.
        dist.all_reduce(torch.zeros(1, device=device))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    logger.info("rank %d of %d on %s", rank, world_size, device)
    return Ranks(rank, world_size, device, control, owns_group=owns_group, _threads=threads)


def _wait_until_ready(store: dist.Store, workers: list[BaseProcess]) -> None:
    """Wait until every started rank has connected to the store, failing fast when one
    exits first."""
    keys = [_READY_KEY.format(rank=rank) for rank in range(1, len(workers) + 1)]
    deadline = time.monotonic() + START_TIMEOUT.total_seconds()
    while not store.check(keys):
        for worker in workers:
            if not worker.is_alive():
                raise RuntimeError(
                    f"tensor-parallel rank process {worker.name} exited with code "
                    f"{worker.exitcode} while starting; its error is printed above"
                )
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks did not start within {START_TIMEOUT}")
        time.sleep(0.02)


def _watch_workers(workers: list[BaseProcess], stop: threading.Event) -> None:
    """Log an error for each started rank that exits before `stop` is set."""
    running = list(workers)
    while running and not stop.wait(WATCH_SECONDS):
        for worker in [w for w in running if not w.is_alive()]:
            running.remove(worker)
            if not stop.is_set():
                logger.error(
                    "tensor-parallel rank process %s exited with code %s while the engine is "
                    "open; its error, if it had one, is in the log above. The engine cannot "
                    "continue: rank 0 waits for it in every collective. Close the engine and "
                    "start a new one.",
                    worker.name,
                    worker.exitcode,
                )


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    device_type: str,
    parent_pid: int,
    log_level: int,
    entry: Callable[..., None],
    args: tuple,
) -> None:
    """A started rank's process: log as rank 0 does (stacks on SIGUSR1), join rank 0, run
    `entry`, leave the groups; when `entry` raises, log the error and exit at once."""
    logging.basicConfig(level=log_level, format=f"rank {rank}: %(levelname)s %(name)s: %(message)s")
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    _exit_with_parent(parent_pid)
    store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=START_TIMEOUT)
    store.set(_READY_KEY.format(rank=rank), "1")
    ranks = _init(rank, world_size, device_type, local_rank=rank, store=store)
    try:
        entry(ranks, *args)
    except BaseException:
        # Leaving the groups would wait on collectives rank 0 never joins; the error is
        # logged now and the process ends (rank 0's watcher reports it).
        logger.exception("rank %d failed; exiting", rank)
        logging.shutdown()
        os._exit(1)
    ranks.close()


def _exit_with_parent(parent_pid: int) -> None:
    """End this process as soon as the process that started it is gone (it would otherwise
    wait for commands forever)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="specrun-parent-watch", daemon=True).start()
