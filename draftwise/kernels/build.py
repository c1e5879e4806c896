"""Compiling one ISA's kernel module on a first start: its translation units in parallel, each at its
own optimisation level, linked against libtorch and imported as a Python extension module.

torch.utils.cpp_extension.load compiles every unit with the same flags. The kernels' unit needs -O3
(its register tiles are unrolled and inlined by the optimiser); the bindings' unit is glue - pybind11
argument casters, the loop over a step's layers, suffix search, each called once a step - and at -O1
it compiles in a quarter less time (12-13 s instead of 16-17 s on a Zen 4 core), so that the two
units, one a core, finish together and a first start waits ~3 s less. The flags are torch's own for
an extension (its include and library folders, the module name macro, C++20), so the module is the
one torch's builder would make.

A build writes its library under a temporary name and renames it into place when it is whole: a
build killed midway (Ctrl-C on a first start) leaves nothing a later start would load. Each unit's
compiler output goes to `build.log` in the build folder, which a failed build names."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import shlex
import subprocess
import sysconfig

import torch


@dataclasses.dataclass(frozen=True)
class Unit:
    """One translation unit and its optimisation level."""
    source: str
    opt: str = "-O3"


class BuildError(RuntimeError):
    """A unit that did not compile or a library that did not link; the message names which."""


def compile_flags(name: str) -> list[str]:
    """What torch's builder passes for a CPU extension named `name`: its headers, Python's, the module
    name macro, C++20 position-independent code, the C++ ABI torch was built with."""
    from torch.utils.cpp_extension import include_paths
    flags = [f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    for folder in [*include_paths(), sysconfig.get_paths()["include"]]:
        flags += ["-isystem", folder]
    return [*flags, "-fPIC", "-std=c++20"]


def link_flags() -> list[str]:
    from torch.utils.cpp_extension import library_paths
    return ["-shared", *(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]


def library_path(name: str, directory: str) -> str:
    """Where `build_library` puts the module `name` built in `directory`."""
    return os.path.join(directory, name + ".so")


def build_library(name: str, units: list[Unit], cflags: list[str], ldflags: list[str], directory: str) -> str:
    """Compile `units` in parallel (one compiler process each) with `cflags` and each unit's own
    level, link them into `directory/name.so`, and return its path. Raises BuildError naming the
    failed step; the compilers' output is in `directory/build.log`."""
    os.makedirs(directory, exist_ok=True)
    cxx = shlex.split(os.environ.get("CXX", "c++"))      # e.g. "ccache g++"
    log_path = os.path.join(directory, "build.log")
    flags = [*compile_flags(name), *cflags]
    objects, procs = [], []
    with open(log_path, "w") as log:
        for unit in units:
            obj = os.path.join(directory, os.path.splitext(os.path.basename(unit.source))[0] + ".o")
            cmd = [*cxx, *flags, unit.opt, "-c", unit.source, "-o", obj]
            log.write(" ".join(cmd) + "\n")
            log.flush()
            procs.append((unit, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
            objects.append(obj)
        failed = [unit.source for unit, p in procs if p.wait() != 0]
        if failed:
            names = ", ".join(map(os.path.basename, failed))
            raise BuildError(f"{cxx[-1]} failed on {names}: {_first_error(log_path)} "
                             f"(the compiler's output: {log_path})")
        final = library_path(name, directory)
        partial = f"{final}.{os.getpid()}.partial"
        cmd = [*cxx, *objects, *ldflags, *link_flags(), "-o", partial]
        log.write(" ".join(cmd) + "\n")
        log.flush()
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            raise BuildError(f"linking {name} failed: {_first_error(log_path)} (the linker's output: {log_path})")
    os.replace(partial, final)
    return final


def import_library(name: str, path: str):
    """The extension module `name` from the library at `path`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _first_error(log_path: str) -> str:
    with open(log_path, errors="replace") as f:
        lines = f.read().splitlines()
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["no output"])[0][:300]
