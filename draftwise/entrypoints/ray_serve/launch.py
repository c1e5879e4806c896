"""`draftwise serve --data-parallel-size N`: N engine replicas and one HTTP ingress on Ray Serve.

Two Ray Serve applications: `draftwise-engines` (the `EngineReplica` deployment, N replicas, routed
by `DraftwiseRequestRouter`, health-checked on the engine thread) and `draftwise` (the ingress: the
single-process server's FastAPI app over `RayEngineClient`, behind Ray Serve's HTTP proxy at
--host/--port). The ingress learns the model's facts from a replica (`describe`) and loads only the
tokenizer. Without --ray-address a local Ray instance is started; with it, the command joins a
running cluster (every node must see the model at the same path, as with vLLM). SIGTERM / SIGINT
deletes both applications: Ray Serve stops routing new requests and gives running ones up to
--shutdown-timeout seconds to finish."""
from __future__ import annotations

import dataclasses
import logging
import signal
import threading

from draftwise.distributed.ray_utils import connect
from draftwise.engine_args import EngineArgs
from draftwise.entrypoints.openai.api_server import build_app
from draftwise.entrypoints.openai.frontend import ModelFrontend
from draftwise.entrypoints.ray_serve.client import RayEngineClient
from draftwise.entrypoints.ray_serve.replica import EngineReplica
from draftwise.entrypoints.ray_serve.router import DraftwiseRequestRouter

logger = logging.getLogger("draftwise.serve")

ENGINE_APP, ENGINE_DEPLOYMENT, INGRESS_APP = "draftwise-engines", "EngineReplica", "draftwise"


def engine_deployment(engine_options: dict, args):
    """The engine replicas' Ray Serve deployment (bound, ready for serve.run)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    cpus = args.replica_cpus if args.replica_cpus is not None else float(engine_options.get("threads") or 1)
    queued = None if args.max_num_queued_requests is not None and args.max_num_queued_requests < 0 \
        else args.max_num_queued_requests
    dep = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT, num_replicas=args.data_parallel_size,
        max_ongoing_requests=10_000,            # admission control is the engine loop's (429 with a reason)
        max_replicas_per_node=args.max_replicas_per_node,
        ray_actor_options={"num_cpus": cpus, "num_gpus": args.replica_gpus},
        health_check_period_s=2.0, health_check_timeout_s=30.0,
        graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=args.shutdown_timeout,
        request_router_config=RequestRouterConfig(
            request_router_class=DraftwiseRequestRouter, request_routing_stats_period_s=1.0,
            request_routing_stats_timeout_s=5.0,
            request_router_kwargs={"mode": args.routing, "block_size": engine_options.get("block_size", 16)}))
    return dep.bind(engine_options, queued)


def ingress_deployment(info: dict, args, api_key: str | None):
    from ray import serve

    @serve.ingress()
    class Ingress:
        def __init__(self):
            self.info = info

        def __serve_build_asgi_app__(self):
            handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=ENGINE_APP)
            return build_app(None, args.served_model_name or args.model, api_key=api_key,
                             max_request_bytes=args.max_request_bytes, playground=args.playground,
                             frontend=ModelFrontend.from_description(info),
                             make_engine_client=lambda metrics: RayEngineClient(handle, metrics))

    return serve.deployment(Ingress, name="Ingress", num_replicas=1, max_ongoing_requests=10_000,
                            ray_actor_options={"num_cpus": 0},
                            graceful_shutdown_wait_loop_s=0.5,
                            graceful_shutdown_timeout_s=args.shutdown_timeout).bind()


def engine_options_of(args) -> dict:
    return dataclasses.asdict(EngineArgs.from_cli_args(args))


def existing_serve_verdict(wanted: tuple[str, int], running: tuple[str, int], apps: set[str]) -> str:
    """What to do with the Ray Serve instance a cluster already runs (Ray Serve keeps its first
    HTTP options and ignores a later serve.start's): "keep" where it listens where asked;
    "replace" where it holds only draftwise's applications or none (left by a `draftwise serve`
    that did not shut down: a new one on another port would otherwise say it serves where nothing
    listens); otherwise a ValueError naming the port it is on - other applications are not ours
    to stop."""
    if running == wanted:
        return "keep"
    others = sorted(apps - {ENGINE_APP, INGRESS_APP})
    if not others:
        return "replace"
    raise ValueError(f"Ray Serve already runs on this cluster with its HTTP proxy at {running[0]}:{running[1]} "
                     f"(applications: {', '.join(others)}); serve there (--host {running[0]} --port "
                     f"{running[1]}) or stop that instance first")


def start_serve(host: str, port: int) -> None:
    """Ray Serve with its HTTP proxy at host:port (see existing_serve_verdict)."""
    from ray import serve
    from ray.serve.context import _get_global_client
    serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
    http = _get_global_client().http_config
    verdict = existing_serve_verdict((host, port), (http.host, http.port), set(serve.status().applications))
    if verdict == "replace":
        logger.warning("replacing the Ray Serve instance left on this cluster (HTTP proxy at %s:%d, no "
                       "applications but draftwise's)", http.host, http.port)
        serve.shutdown()
        serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})


def start(args, api_key: str | None) -> dict:
    """Deploy both applications (connecting to / starting Ray first); -> the replicas' description."""
    from ray import serve
    connect(args.ray_address)
    start_serve(args.host, args.port)
    serve.run(engine_deployment(engine_options_of(args), args), name=ENGINE_APP, route_prefix=None)
    info = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=ENGINE_APP).describe.remote().result()
    serve.run(ingress_deployment(info, args, api_key), name=INGRESS_APP, route_prefix="/")
    return info


def stop() -> None:
    """Drain and delete both applications (running requests get the graceful-shutdown time)."""
    from ray import serve
    for app in (INGRESS_APP, ENGINE_APP):
        try:
            serve.delete(app)
        except Exception:              # noqa: BLE001 - already gone
            logger.exception("deleting %s failed", app)


def run(args, api_key: str | None) -> None:
    """Serve until SIGTERM / SIGINT."""
    import ray
    connect(args.ray_address)              # ray.init installs its own signal handlers: ours go after
    done = threading.Event()               # a signal during start-up stops right after it
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    info = start(args, api_key)
    logger.info("serving %r on Ray: %d engine replica(s), http://%s:%d (max_model_len=%d)",
                args.served_model_name or args.model, args.data_parallel_size, args.host, args.port,
                info["max_model_len"])
    done.wait()
    logger.info("stopping: draining running requests (up to %.0fs)", args.shutdown_timeout)
    stop()
    from ray import serve
    serve.shutdown()
    ray.shutdown()
