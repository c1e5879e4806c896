"""The `serve` flags of scale-out on Ray, and whether a parsed command line asks for it (no Ray
import: the single-process server reads these too)."""
from __future__ import annotations


def add_ray_args(parser) -> None:
    g = parser.add_argument_group("scale-out on Ray (pip install 'draftwise[ray]')")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas behind one endpoint; above 1 the server runs on Ray Serve (default: 1)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. 10.0.0.1:6379); default: start a local one")
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs each engine replica reserves from Ray (default: --threads, else 1)")
    g.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs each engine replica reserves (default: 0)")
    g.add_argument("--max-replicas-per-node", type=int, default=None,
                   help="at most this many engine replicas on one node (1: one per machine)")
    g.add_argument("--routing", choices=["affinity", "round_robin"], default="affinity",
                   help="replica choice: session / prompt-prefix affinity held back by load, or round robin "
                        "(default: affinity)")


def uses_ray(args) -> bool:
    """Whether `serve` runs on Ray (more than one replica, or a cluster to join); checks the flags
    and that Ray Serve is installed."""
    n = getattr(args, "data_parallel_size", 1)
    if n < 1:
        raise SystemExit(f"--data-parallel-size must be >= 1, got {n}")
    if n == 1 and not getattr(args, "ray_address", None):
        return False
    import importlib.util
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise SystemExit("--data-parallel-size > 1 / --ray-address need Ray Serve: pip install 'draftwise[ray]'")
    return True
