"""The FastAPI app of the OpenAI-compatible server, and `draftwise serve`.

    draftwise serve --model HuggingFaceTB/SmolLM2-135M-Instruct --port 8000

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as
server-sent events ending in `data: [DONE]`), GET /v1/models, GET /health, GET /metrics
(Prometheus text), GET /openapi.json (the request/response models of protocol.py).

Every malformed request is a 4xx with OpenAI's error shape ({"error": {message, type, param,
code}}), never a 500: pydantic validation errors are mapped to 400 naming the field. A client
that disconnects aborts its request (its KV blocks are freed at once). SIGTERM: new /v1 requests
get 503, running ones finish within --shutdown-timeout seconds, then the engine thread stops."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
import threading
import time

from fastapi import FastAPI

from draftwise.entrypoints.openai.errors import install_error_handlers
from draftwise.entrypoints.openai.frontend import ModelFrontend
from draftwise.entrypoints.openai.gate import Gate
from draftwise.entrypoints.openai.playground import add_playground_routes
from draftwise.entrypoints.openai.routes import ServerState, add_routes, default_max_request_bytes
from draftwise.entrypoints.openai.serving import EngineLoop, PromptPreparer, ServerMetrics, release_free_memory
from draftwise.engine_args import EngineArgs
from draftwise.entrypoints.llm import LLM
from draftwise.entrypoints.ray_serve.options import add_ray_args

logger = logging.getLogger("draftwise.serve")


def build_app(llm, served_model_name: str, api_key: str | None = None, max_request_bytes: int | None = None,
              max_num_queued_requests: int | None = 64, playground: bool = True, *,
              frontend: ModelFrontend | None = None, make_engine_client=None):
    """The FastAPI app serving `llm` (an `LLM`) under the name `served_model_name`, with the browser
    playground at `/` unless `playground` is False. The engine thread starts with the app's
    lifespan (so run it under uvicorn or `with TestClient(app)`).

    Without a local model (`llm` None) the app serves through `make_engine_client(metrics)`, any
    object with EngineLoop's start / stop / alive / is_idle / submit / abort (the Ray ingress),
    and `frontend` describes the model."""
    metrics = ServerMetrics()
    if llm is not None:
        frontend = ModelFrontend.of_engine(llm.engine)
        engine_client = EngineLoop(llm, metrics, max_num_queued_requests=max_num_queued_requests)
    else:
        engine_client = make_engine_client(metrics)
    max_len = frontend.max_model_len
    state = ServerState(frontend, served_model_name, api_key or None, metrics, engine_client,
                        PromptPreparer(frontend, max_prompt_chars=max_len * 64),
                        max_request_bytes or default_max_request_bytes(max_len))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        release_free_memory()                 # what loading and compiling freed
        state.engine_loop.start()
        logger.info("serving %r (max_model_len=%d)", served_model_name, max_len)
        try:
            yield
        finally:
            state.draining = True
            await asyncio.to_thread(state.engine_loop.stop)
            if llm is not None:
                llm.engine.shutdown()         # tensor-parallel workers, if any

    app = FastAPI(title="draftwise OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(Gate, state=state)
    install_error_handlers(app, metrics)
    if playground:
        add_playground_routes(app)
    add_routes(app, state)
    return app


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------
def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The engine's flags (EngineArgs) and the server's own."""
    EngineArgs.add_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (or set DRAFTWISE_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="model id clients send (default: --model)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish on SIGTERM; new ones get 503 meanwhile "
                        "(default: 30)")
    g.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body accepted, else 413 (default: room for a full context, "
                        "at least 1 MiB)")
    g.add_argument("--max-num-queued-requests", type=int, default=64,
                   help="requests that may wait beyond the running batch, else 429 with Retry-After; "
                        "-1: no limit (default: 64)")
    g.add_argument("--no-playground", dest="playground", action="store_false",
                   help="do not serve the browser playground at /")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_ray_args(parser)
    return parser


def drain(state: ServerState, timeout: float) -> None:
    """Refuse new requests (503), wait up to `timeout` seconds for running ones to finish, then end
    the rest (streams: an error event and [DONE]; others: their partial output, finish_reason
    "abort") and stop the engine thread. Blocking: run it off the event loop."""
    state.draining = True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not state.engine_loop.is_idle:
        time.sleep(0.05)
    state.engine_loop.stop()                # ends whatever is left, each with its final event
    time.sleep(0.1)                         # let the event loop write those events


def configure_logging(args) -> None:
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def api_key_of(args) -> str | None:
    return args.api_key or os.environ.get("DRAFTWISE_API_KEY") or None


def run_server(args, llm=None) -> None:
    """Serve `llm` (built from `args`' engine flags when not given) until SIGTERM / SIGINT."""
    import uvicorn
    configure_logging(args)
    api_key = api_key_of(args)
    if llm is None:
        llm = LLM.from_engine_args(EngineArgs.from_cli_args(args))
    name = args.served_model_name or args.model
    queued = None if args.max_num_queued_requests is not None and args.max_num_queued_requests < 0 \
        else args.max_num_queued_requests
    app = build_app(llm, name, api_key=api_key, max_request_bytes=args.max_request_bytes,
                    max_num_queued_requests=queued, playground=args.playground)
    state: ServerState = app.state.server

    class _Server(uvicorn.Server):
        """SIGTERM / SIGINT drain: the listener stays open (new /v1 requests get 503, /health says
        draining) while running requests finish, for up to --shutdown-timeout seconds; what is
        still running then ends with an error event and [DONE] (streams) or finish_reason "abort";
        then uvicorn closes. A second signal stops at once."""

        def handle_exit(self, sig, frame):
            if state.draining:
                self._stop_uvicorn(sig, frame)
                return
            logger.info("signal %s: refusing new requests, finishing running ones (up to %.0fs)",
                        sig, args.shutdown_timeout)
            state.draining = True
            threading.Thread(target=self._drain, args=(sig, frame), name="draftwise-drain", daemon=True).start()

        def _drain(self, sig, frame):
            drain(state, args.shutdown_timeout)
            self._stop_uvicorn(sig, frame)

        def _stop_uvicorn(self, sig, frame):
            super().handle_exit(sig, frame)
            # a graceful stop is a clean exit: do not let uvicorn re-raise the signal afterwards
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without an API key", args.host)
    _Server(config).run()
    logger.info("server stopped")
    # skip the interpreter's final teardown (seconds of garbage collection over the model's objects):
    # everything worth keeping is written already
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

