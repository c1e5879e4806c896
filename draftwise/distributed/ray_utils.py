"""Connecting to Ray (an optional extra: only imported when a command asks for Ray)."""
from __future__ import annotations

import logging


def loopback_host(address: str | None) -> str | None:
    """A cluster on loopback addresses (several nodes on one machine, head on 127.0.0.2): a process
    joining it must register on the head's address, since Ray would pick the machine's own."""
    host = (address or "").rsplit(":", 1)[0]
    return host if host.startswith("127.") else None


def connect(address: str | None = None) -> None:
    """Join the Ray cluster at `address` (default: $RAY_ADDRESS, else a new local instance);
    a no-op inside a Ray worker or when already connected."""
    import os
    import ray
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
             _node_ip_address=loopback_host(address))


def node_ip() -> str:
    import ray
    return ray.util.get_node_ip_address()
