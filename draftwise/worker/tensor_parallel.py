"""Tensor-parallel worker processes and the driver that leads them.

Rank 0 is the engine process itself (scheduler, sampler, drafters, and its own target shard); ranks
1..N-1 are fresh Python processes on this machine (`LocalRanks`), or Ray actors spread over a
cluster's nodes (`RayRanks`, `distributed_executor_backend="ray"`), meeting at rank 0's node
address. Each loads and shards the target, reports ready through the
rendezvous store, and only then joins the process group (a worker that fails to start is reported
with its error instead of a rendezvous timeout).

Every rank runs the same ModelRunner (as nano-vllm's ranks do). On rank 0 the engine's runner is
wrapped in `TensorParallelRunner`: before each step it broadcasts the step's SchedulerOutput
(`for_workers()`: requests reduced to their KV blocks) with `broadcast_object_list`; every rank
prepares the same tensors from it and runs its shard of the target forward, meeting at the
all-reduces inside the layers; rank 0 gathers the logits and samples. After tree verification rank
0 broadcasts the accepted rows and every rank keeps the same accepted paths in its KV cache.
Commands: init (the KV pool's size), step, accept, measure (the start-up cost table), shutdown.

Failure handling: the driver checks its workers before each broadcast and a collective with a dead
peer raises at once (gloo notices the closed connection), so a crashed worker turns every later step
into a RuntimeError naming it - the engine fails its requests instead of hanging (and reports
itself broken: a server's health check fails). Workers exit when the engine shuts down or its
connection closes; Ray actors are also killed."""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from draftwise.step import EngineFault
from draftwise.distributed.ray_utils import connect, node_ip
from draftwise.distributed.tensor_parallel import shard_target
from draftwise.models.loader import load_target_model
from draftwise.worker.model_runner import ModelRunner

logger = logging.getLogger("draftwise")

TIMEOUT = datetime.timedelta(seconds=300)


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _backend(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def threads_per_rank(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


class LocalRanks:
    """Ranks 1..N-1 as fresh Python processes on this machine (`python -m draftwise.worker.tensor_parallel`,
    so nothing depends on how the engine process was started); their output goes to temp files."""

    def __init__(self, config, world: int, host: str, port: int):
        fd, self.config_path = tempfile.mkstemp(prefix="draftwise-tp-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(config, f)
        self.logs = [tempfile.TemporaryFile() for _ in range(1, world)]
        self.procs = [subprocess.Popen([sys.executable, "-m", "draftwise.worker.tensor_parallel", self.config_path,
                                        str(rank), str(world), str(port), host], stdout=log, stderr=log)
                      for rank, log in zip(range(1, world), self.logs)]

    def _tail(self, rank: int) -> str:
        log = self.logs[rank - 1]
        log.seek(0)
        lines = log.read().decode(errors="replace").strip().splitlines()
        return (": " + lines[-1]) if lines else ""

    def dead(self, force: bool = False) -> str | None:
        """What ended the first dead rank, None while all run."""
        for rank, p in enumerate(self.procs, 1):
            if p.poll() is not None:
                return f"tensor-parallel worker {rank} exited (exit code {p.returncode}){self._tail(rank)}"
        return None

    def stop(self, timeout: float) -> None:
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for log in self.logs:
            log.close()
        try:
            os.unlink(self.config_path)
        except OSError:
            pass


class RayRanks:
    """Ranks 1..N-1 as Ray actors (multi-node tensor parallelism): each rank prefers a node other
    than rank 0's, round robin over the cluster's live nodes (falling back to any node with room),
    and runs `worker_main` as one long actor task. A rank's death shows as that task's error."""

    CHECK_EVERY_S = 0.5

    def __init__(self, config, world: int, host: str, port: int):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        own = ray.get_runtime_context().get_node_id()
        others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != own] or [own]
        actor_cls = ray.remote(TPRankActor)
        self.actors, self.refs = [], []
        for rank in range(1, world):
            node = others[(rank - 1) % len(others)]
            actor = actor_cls.options(num_cpus=threads_per_rank(world), max_restarts=0, max_concurrency=2,
                                      scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True)).remote()
            self.actors.append(actor)
            self.refs.append(actor.run.remote(config, rank, world, port, host))
        self.node_ips = ray.get([a.node_ip.remote() for a in self.actors], timeout=120)
        self.pids = ray.get([a.pid.remote() for a in self.actors], timeout=120)
        self._checked = 0.0

    def dead(self, force: bool = False) -> str | None:
        """What ended the first dead rank, None while all run (asks Ray at most every
        CHECK_EVERY_S unless forced: a dead peer also fails the next collective at once)."""
        import ray
        now = time.monotonic()
        if not force and now - self._checked < self.CHECK_EVERY_S:
            return None
        self._checked = now
        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        for ref in done:
            rank = self.refs.index(ref) + 1
            try:
                ray.get(ref)
                return f"tensor-parallel worker {rank} (Ray actor on {self.node_ips[rank - 1]}) exited"
            except Exception as e:     # noqa: BLE001 - the actor died or its loop raised
                return f"tensor-parallel worker {rank} (Ray actor on {self.node_ips[rank - 1]}) died: " \
                       f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return None

    def stop(self, timeout: float) -> None:
        import ray
        try:
            ray.wait(self.refs, num_returns=len(self.refs), timeout=timeout)
        except Exception:              # noqa: BLE001
            pass
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:          # noqa: BLE001
                pass


class TPRankActor:
    """One worker rank as a Ray actor (wrapped with ray.remote by RayRanks)."""

    def node_ip(self) -> str:
        return node_ip()

    def pid(self) -> int:
        return os.getpid()

    def run(self, config, rank: int, world: int, port: int, host: str) -> None:
        worker_main(config, rank, world, port, host)


class TPDriver:
    """Rank 0's side: starts the worker ranks (local processes, or Ray actors with
    `distributed_executor_backend="ray"`), joins the process group, broadcasts commands."""

    def __init__(self, config, world: int, start_timeout: float = 600.0):
        self.world = world
        self.device = config.device
        self.broken: str | None = None
        self.closed = False
        if config.distributed_executor_backend == "ray":
            connect()
            host = node_ip()               # workers on other nodes meet at rank 0's address
        else:
            host = "127.0.0.1"
        port = _free_port(host)
        self.store = dist.TCPStore(host, port, world, True, timeout=TIMEOUT, wait_for_workers=False)
        launcher = RayRanks if config.distributed_executor_backend == "ray" else LocalRanks
        self.ranks = launcher(config, world, host, port)
        atexit.register(self.shutdown)
        deadline = time.time() + start_timeout
        for rank in range(1, world):
            while not self._ready(rank):
                self._check()
                if time.time() > deadline:
                    self.shutdown()
                    raise RuntimeError(f"tensor-parallel worker {rank} did not start in {start_timeout:.0f} s")
                time.sleep(0.05)
        dist.init_process_group(_backend(config.device), store=self.store, rank=0, world_size=world,
                                timeout=TIMEOUT)

    def _ready(self, rank: int) -> bool:
        try:
            return self.store.check([f"ready{rank}"])
        except Exception:              # noqa: BLE001
            return False

    def _check(self) -> None:
        if self.broken is None:
            self.broken = self.ranks.dead()
        if self.broken is not None:
            raise EngineFault(self.broken + "; restart the engine")
        if self.closed:
            raise EngineFault("the tensor-parallel workers were shut down")

    def send(self, kind: str, payload=None) -> None:
        self._check()
        try:
            dist.broadcast_object_list([(kind, payload)], src=0)
        except Exception as e:         # a peer went away mid-collective
            self._fail(e)

    def collective(self, fn):
        """Run rank 0's part of a step (its own shard), turning a failed collective into a clear error."""
        try:
            return fn()
        except RuntimeError as e:
            self._fail(e)

    def _fail(self, err: Exception):
        """A collective failed: name the rank that died if its death shows within a few seconds."""
        deadline = time.time() + 5.0
        while self.broken is None and time.time() < deadline:
            self.broken = self.ranks.dead(force=True)
            if self.broken is None:
                time.sleep(0.2)
        self.broken = self.broken or f"tensor-parallel collective failed ({err})"
        raise EngineFault(self.broken) from None

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.closed:
            return
        try:
            if self.broken is None:
                self.send("shutdown")
        except RuntimeError:
            pass
        self.closed = True
        self.ranks.stop(timeout)
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:              # noqa: BLE001 - already gone
            pass


class TensorParallelRunner:
    """Rank 0's ModelRunner with the worker ranks in step: each step's SchedulerOutput goes to every
    rank before rank 0 runs it, so the engine drives N ranks exactly as it drives one runner
    (everything else - drafting, timers, the KV cache - reads through to rank 0's runner)."""

    def __init__(self, runner, driver):
        self.__dict__.update(runner=runner, driver=driver)
        driver.send("init", {"num_blocks": runner.kv_cache.num_blocks})

    def __getattr__(self, name):
        return getattr(self.__dict__["runner"], name)

    def __setattr__(self, name, value):
        setattr(self.__dict__["runner"], name, value)

    def execute(self, out):
        return self.run(self.prepare(out))

    def run(self, inp):
        self.driver.send("step", inp.sched.for_workers())
        result = self.driver.collective(lambda: self.runner.run(inp))
        if any(result.accepted_rows):
            self.driver.send("accept", result.accepted_rows)
        return result

    def measure_target_costs(self, sizes, repeats: int = 3, context: int = 0, large_repeats: int | None = 2,
                             budget_s: float = 0.0):
        """Every rank runs the same forwards (a collective each), so no time budget: fixed rounds."""
        self.driver.send("measure", {"sizes": list(sizes), "repeats": repeats, "context": context,
                                     "large_repeats": large_repeats})
        return self.driver.collective(lambda: self.runner.measure_target_costs(sizes, repeats, context, large_repeats))


def worker_main(config, rank: int, world: int, port: int, host: str = "127.0.0.1") -> None:
    """A worker rank: load and shard the target, then execute broadcast commands until shutdown."""
    torch.set_num_threads(threads_per_rank(world))
    torch.set_grad_enabled(False)
    model, cfg, _ = load_target_model(config.model, config.torch_dtype, config.device,
                                      max_position=config.max_model_len + 256)
    store = dist.TCPStore(host, port, world, False, timeout=TIMEOUT)
    store.set(f"ready{rank}", "1")
    dist.init_process_group(_backend(config.device), store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    shard_target(model, rank, world)
    runner, step = None, None
    try:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            kind, payload = box[0]
            if kind == "shutdown":
                break
            if kind == "init":             # the same runner as rank 0's, without drafter or sampler
                runner = ModelRunner(config, model, cfg, None, payload["num_blocks"])
            elif kind == "step":
                step = runner.prepare(payload, sampling=False)
                runner.forward(step)
            elif kind == "accept":
                runner.keep_accepted_paths(step, payload)
            elif kind == "measure":
                runner.measure_target_costs(payload["sizes"], payload["repeats"], payload["context"],
                                            payload["large_repeats"])
            else:
                raise RuntimeError(f"unknown tensor-parallel command {kind!r}")
    finally:
        try:
            dist.destroy_process_group()
        except Exception:              # noqa: BLE001
            pass


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        cfg = pickle.load(f)
    worker_main(cfg, int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
