"""A Ray cluster of several nodes on one machine, for tests: each node a `ray start --block` on its
own loopback address (127.0.0.2, 127.0.0.3, ...; Ray rewrites 127.0.0.1 to the machine's address)
with its own ports, and `draftwise serve` on it as a subprocess. Teardown kills exactly the
processes this cluster started (each node's process tree, found through /proc), never `ray stop`,
which would end every Ray process on the machine."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_DEDUP_LOGS": "0"}


def ray_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.serve") is not None


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind((host, 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first found through /proc/*/stat's parent field)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(proc: subprocess.Popen, grace: float = 3.0) -> None:
    pids = [proc.pid] + descendants(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace
        while time.time() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class LoopbackRayCluster:
    def __init__(self, num_nodes: int = 2, cpus_per_node: int = 2):
        self.ips = [f"127.0.0.{2 + i}" for i in range(num_nodes)]
        self.cpus = cpus_per_node
        self.nodes: list[subprocess.Popen] = []
        self.tmp = tempfile.mkdtemp(prefix="dwray", dir="/tmp")    # Unix socket paths must stay short
        self.env = {**os.environ, **RAY_ENV}
        self.logs = []
        self.gcs_port = None
        self._worker_ranges: list[tuple[int, int]] = []

    @property
    def address(self) -> str:
        return f"{self.ips[0]}:{self.gcs_port}"

    def _ports(self, n: int) -> list[int]:
        """n free ports, none inside a worker-port range (this node's: the third port + 60, or an
        earlier node's): Ray refuses a port that another of its components may take."""
        while True:
            p = free_ports(n)
            ranges = self._worker_ranges + [(p[2], p[2] + 60)]
            if all(not (lo <= x <= hi) for x in p[:2] + p[3:] for lo, hi in ranges) and \
                    all(not (lo <= p[2] + 60 and p[2] <= hi) for lo, hi in self._worker_ranges):
                self._worker_ranges.append((p[2], p[2] + 60))
                return p

    def _start_node(self, i: int) -> subprocess.Popen:
        ip = self.ips[i]
        p = self._ports(9)
        args = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block",
                f"--node-ip-address={ip}", f"--num-cpus={self.cpus}", "--disable-usage-stats",
                f"--node-manager-port={p[0]}", f"--object-manager-port={p[1]}",
                f"--min-worker-port={p[2]}", f"--max-worker-port={p[2] + 60}",
                f"--dashboard-agent-listen-port={p[3]}", f"--metrics-export-port={p[4]}",
                f"--runtime-env-agent-port={p[5]}", f"--dashboard-agent-grpc-port={p[6]}",
                "--object-store-memory=200000000"]
        if i == 0:
            self.gcs_port = p[7]
            args += ["--head", f"--port={self.gcs_port}", "--include-dashboard=false",
                     f"--ray-client-server-port={p[8]}", f"--temp-dir={self.tmp}"]
        else:
            args += [f"--address={self.address}"]
        log = open(os.path.join(self.tmp, f"node{i}.log"), "wb")
        self.logs.append(log)
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)

    def start(self, timeout: float = 90.0) -> "LoopbackRayCluster":
        try:
            for i in range(len(self.ips)):
                self._join_node(i, timeout)
        except BaseException:
            self.stop()                # a node that did start must not outlive the failure
            raise
        return self

    def _join_node(self, i: int, timeout: float, attempts: int = 3) -> None:
        """Start node i (0: the head) and wait until the head lists it. `ray start` gives a raylet 30 s to
        register with the GCS and then exits; on a loaded 2-core machine that can pass, so a node
        whose process exits is started again on fresh ports, up to `attempts` times."""
        for attempt in range(attempts):
            proc = self._start_node(i)
            self.nodes.append(proc)
            deadline = time.time() + timeout
            head_up = i > 0 or self._port_opens(self.ips[0], self.gcs_port, deadline, proc)
            while head_up and time.time() < deadline and proc.poll() is None:
                if len(self.alive_nodes()) >= i + 1:
                    return
                time.sleep(1)
            log = self.node_log(i)
            if proc.poll() is None:
                break                      # still running but never listed: a retry would not help
            self.nodes.remove(proc)
            kill_tree(proc)
            os.replace(os.path.join(self.tmp, f"node{i}.log"),
                       os.path.join(self.tmp, f"node{i}.attempt{attempt}.log"))
        raise TimeoutError(f"Ray node {i} did not come up: {log}")

    @staticmethod
    def _port_opens(host: str, port: int, deadline: float, proc: subprocess.Popen) -> bool:
        """True once host:port accepts a connection; False at the deadline or when proc exits."""
        while time.time() < deadline and proc.poll() is None:
            try:
                socket.create_connection((host, port), 0.5).close()
                return True
            except OSError:
                time.sleep(0.2)
        return False

    def alive_nodes(self) -> list[str]:
        code = ("import ray,json; ray.init(address=%r, _node_ip_address=%r, logging_level='ERROR');"
                "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))"
                % (self.address, self.ips[0]))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=self.env,
                             timeout=60)
        import json
        try:
            return json.loads(out.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            return []

    def node_log(self, i: int) -> str:
        try:
            with open(os.path.join(self.tmp, f"node{i}.log"), "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        self._stopped_pids = [q for p in self.nodes for q in [p.pid] + descendants(p.pid)]
        for p in reversed(self.nodes):
            kill_tree(p)
        for log in self.logs:
            log.close()

    def leftovers(self) -> list[str]:
        """Processes of this cluster still alive: those it had when stopped (Ray renames its
        workers' command lines) and any whose command line names its temp dir."""
        out = [f"{pid}: process of the stopped cluster" for pid in getattr(self, "_stopped_pids", [])
               if _alive(pid)]
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or not _alive(int(entry)):
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if self.tmp in cmd:
                out.append(f"{entry}: {cmd[:120]}")
        return out

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class RayServer:
    """`draftwise serve --ray-address ...` as a subprocess, up until its endpoint answers."""

    def __init__(self, cluster: LoopbackRayCluster, *serve_args: str, timeout: float = 240.0):
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(cluster.tmp, f"serve{self.port}.log")
        self._log = open(self.log_path, "wb")
        cmd = [sys.executable, "-m", "draftwise.entrypoints.cli", "serve", "--ray-address", cluster.address,
               "--port", str(self.port), *serve_args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=cluster.env,
                                     start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"draftwise serve exited: {self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"the Ray endpoint did not come up: {self.log()}")

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-4000:].decode(errors="replace")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (drain and delete the applications), then the process tree if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                kill_tree(self.proc)
        self._log.close()
        return self.proc.returncode
