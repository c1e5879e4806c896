"""What this machine is, as far as kernel choices go, and measurements cached per machine.

Kernel choices are measured, never hard-coded for one CPU; the result is cached on disk keyed by
the torch build, the CPU capability and the ISA flags that decide kernel speed, so every run on the
machine computes the same numbers and later starts skip the measurement."""
from __future__ import annotations

import json
import os

import torch

from draftwise.config import cache_dir


def cpu_flags() -> set[str]:
    """The CPU flags of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def available_memory() -> int | None:
    """Bytes of memory the system can give without swapping (Linux's MemAvailable), or None where
    it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def isa_summary() -> str:
    """The flags that matter for the kernels: AVX2, AVX-VNNI, AVX-512 (BF16, VNNI, ...) and AMX."""
    return ",".join(sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx2", "avx_vnni"))))


def machine_key(*extra) -> str:
    return "-".join([torch.__version__, torch.backends.cpu.get_cpu_capability(), isa_summary(), *map(str, extra)])


def cached_measurement(filename: str, key: str, measure):
    """`measure()` once per key; results JSON-cached in the draftwise cache directory (`filename`)."""
    path = os.path.join(cache_dir(), filename)
    try:
        with open(path) as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = measure()
        try:
            with open(path + ".tmp", "w") as f:
                json.dump(known, f)
            os.replace(path + ".tmp", path)
        except OSError:
            pass
    return known[key]
