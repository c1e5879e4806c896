"""`draftwise bench build-peer`: a virtual environment holding llama.cpp's Python package, built for
this machine or for a narrower instruction set, to compare against on the same CPU.

llama-cpp-python compiles llama.cpp from source at install. Its native build (`GGML_NATIVE`)
enables every instruction set the compiler sees, and on AMX machines that build crashes at load, so
the build here names the instruction sets itself and leaves AMX off:

- `avx512`: AVX-512 F/BW/VL (+ VNNI and BF16 where the CPU has them), the build beside draftwise's
  `avx512` kernels;
- `avx2`: AVX2 + FMA + F16C and no AVX-512, the laptop build beside `DRAFTWISE_ISA=avx2`;
- `auto`: `avx512` where the CPU has AVX-512 F/BW/VL, else `avx2`.

The wheel is built without pip's cache (a cached wheel built for another instruction set would be
reused silently). Use the result with `draftwise bench --peer-python llamacpp=OUT/bin/python`.

`--server` builds llama.cpp's own `llama-server` instead, from the same source PyPI ships (the
sdist's `vendor/llama.cpp`), with the same instruction-set options and no network features:
`OUT/bin/llama-server`, for `draftwise bench --llama-server OUT/bin/llama-server`. A finished build
is reused; a failed step is named and its log kept (`OUT/build.log`)."""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile

from draftwise.machine import cpu_flags

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
AMX_OFF = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


def peer_isa(flags: set[str], isa: str) -> str:
    """The instruction set to build for: `isa` itself, or for "auto" the widest this CPU runs."""
    if isa not in ("auto", "avx512", "avx2"):
        raise ValueError(f"--isa must be auto, avx512 or avx2, got {isa!r}")
    has512 = {"avx512f", "avx512bw", "avx512vl"} <= flags
    has2 = {"avx2", "fma", "f16c"} <= flags
    if isa == "auto":
        isa = "avx512" if has512 else "avx2"
    if isa == "avx512" and not has512:
        raise ValueError("this CPU lacks AVX-512 F/BW/VL: build the avx2 peer (--isa avx2)")
    if isa == "avx2" and not has2:
        raise ValueError("this CPU lacks AVX2 / FMA / F16C: llama.cpp's x86 builds need them")
    return isa


def llamacpp_cmake_args(flags: set[str], isa: str) -> list[str]:
    """llama.cpp's CMake options for `isa` (see peer_isa) on a CPU with `flags`: named instruction
    sets, never the native build, AMX always off."""
    isa = peer_isa(flags, isa)
    common = ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
    if isa == "avx2":
        return common + ["-DGGML_AVX512=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", *AMX_OFF]
    on = lambda flag: "ON" if flag in flags else "OFF"     # noqa: E731
    return common + ["-DGGML_AVX512=ON", f"-DGGML_AVX512_VNNI={on('avx512_vnni')}",
                     f"-DGGML_AVX512_BF16={on('avx512_bf16')}", *AMX_OFF]


def build_llamacpp_env(out: str, isa: str = "auto", version: str = LLAMA_CPP_PYTHON_VERSION,
                       python: str = sys.executable, flags: set[str] | None = None) -> str:
    """Create the virtual environment `out` and build llama-cpp-python `version` into it for `isa`;
    returns its interpreter's path. A failed build raises naming pip's last lines."""
    args = llamacpp_cmake_args(cpu_flags() if flags is None else flags, isa)
    if os.path.exists(os.path.join(out, "bin", "python")):
        raise ValueError(f"{out} already holds a virtual environment: choose another --out or remove it")
    subprocess.run([python, "-m", "venv", out], check=True)
    peer_python = os.path.join(out, "bin", "python")
    env = {**os.environ, "CMAKE_ARGS": " ".join(args), "FORCE_CMAKE": "1"}
    proc = subprocess.run([peer_python, "-m", "pip", "install", "--no-cache-dir", f"llama-cpp-python=={version}"],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise ValueError(f"building llama-cpp-python {version} failed (CMAKE_ARGS={env['CMAKE_ARGS']}):\n{tail}")
    return peer_python


SERVER_CMAKE_ARGS = ("-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF",
                     "-DCMAKE_BUILD_TYPE=Release")


def _step(what: str, cmd: list[str], log: str, cwd: str | None = None) -> None:
    """Run one build step, its output appended to `log`; a failure names the step and the log."""
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd).returncode
    if rc != 0:
        with open(log) as f:
            tail = "\n".join(f.read().strip().splitlines()[-12:])
        raise ValueError(f"building llama-server failed at '{what}' (exit {rc}); the whole log: {log}\n{tail}")


def cmake_binary(out: str, python: str, log: str) -> str:
    """The system's cmake, else PyPI's `cmake` installed into OUT/tools."""
    found = shutil.which("cmake")
    if found:
        return found
    tools = os.path.join(out, "tools")
    _step("pip install cmake (no cmake on PATH)", [python, "-m", "pip", "install", "-q", "--target", tools, "cmake"],
          log)
    exe = glob.glob(os.path.join(tools, "bin", "cmake"))
    if not exe:
        raise ValueError(f"PyPI's cmake installed into {tools} has no bin/cmake; install cmake and run again")
    return exe[0]


def build_llama_server(out: str, isa: str = "auto", version: str = LLAMA_CPP_PYTHON_VERSION,
                       python: str = sys.executable, flags: set[str] | None = None, jobs: int | None = None,
                       say=print) -> str:
    """Build `llama-server` for `isa` from llama-cpp-python `version`'s sdist into OUT/bin; returns
    its path. Reuses a finished build (OUT/bin/llama-server that answers --version)."""
    binary = os.path.join(out, "bin", "llama-server")
    if os.path.isfile(binary) and subprocess.run([binary, "--version"], capture_output=True).returncode == 0:
        say(f"reusing the finished build {binary} (remove {out} to rebuild)")
        return binary
    args = llamacpp_cmake_args(cpu_flags() if flags is None else flags, isa)
    os.makedirs(out, exist_ok=True)
    log = os.path.join(out, "build.log")
    src = os.path.join(out, "src")
    os.makedirs(src, exist_ok=True)
    sdist = glob.glob(os.path.join(src, f"llama_cpp_python-{version}.tar.gz"))
    if not sdist:
        _step("pip download (the llama-cpp-python sdist)", [python, "-m", "pip", "download", "-q", "--no-deps",
                                                             "--no-binary", ":all:", f"llama-cpp-python=={version}",
                                                             "-d", src], log)
        sdist = glob.glob(os.path.join(src, f"llama_cpp_python-{version}.tar.gz"))
    if not sdist:
        raise ValueError(f"pip download left no llama_cpp_python-{version}.tar.gz in {src}; see {log}")
    tree = os.path.join(src, f"llama_cpp_python-{version}", "vendor", "llama.cpp")
    if not os.path.isdir(tree):
        with tarfile.open(sdist[0]) as t:
            t.extractall(src, filter="data")
    cmake = cmake_binary(out, python, log)
    build = os.path.join(out, "build")
    _step("cmake configure", [cmake, "-S", tree, "-B", build, *args, *SERVER_CMAKE_ARGS], log)
    _step("cmake build (llama-server)", [cmake, "--build", build, "-j", str(jobs or os.cpu_count() or 2),
                                          "--target", "llama-server"], log)
    built = glob.glob(os.path.join(build, "bin", "llama-server"))
    if not built:
        raise ValueError(f"the build finished without {build}/bin/llama-server; see {log}")
    os.makedirs(os.path.dirname(binary), exist_ok=True)
    shutil.copy2(built[0], binary)
    return binary


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="draftwise bench build-peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the virtual environment to create")
    p.add_argument("--isa", default="auto", help="auto (this CPU's widest), avx512 or avx2")
    p.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION, help="llama-cpp-python's version")
    p.add_argument("--print-cmake-args", action="store_true", help="print the CMake options and stop")
    p.add_argument("--server", action="store_true",
                   help="build llama.cpp's llama-server (OUT/bin/llama-server) instead of the Python package")
    a = p.parse_args(argv)
    if a.print_cmake_args:
        print(" ".join(llamacpp_cmake_args(cpu_flags(), a.isa) + (list(SERVER_CMAKE_ARGS) if a.server else [])))
        return
    if a.server:
        print(f"building llama-server {a.version} for {peer_isa(cpu_flags(), a.isa)} into {a.out} (about 20 minutes "
              "on 2 cores: llama.cpp compiles from source) ...", flush=True)
        binary = build_llama_server(a.out, a.isa, a.version)
        print(f"done: draftwise bench --llama-server {binary} --methods ar,auto,llamacpp-server,"
              "llamacpp-server:ngram-mod ...")
        return
    print(f"building llama-cpp-python {a.version} for {peer_isa(cpu_flags(), a.isa)} into {a.out} "
          "(minutes: llama.cpp compiles from source) ...", flush=True)
    py = build_llamacpp_env(a.out, a.isa, a.version)
    print(f"done: draftwise bench --peer-python llamacpp={py} --methods ar,llamacpp ...")
