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
reused silently). Use the result with `draftwise bench --peer-python llamacpp=OUT/bin/python`."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="draftwise bench build-peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the virtual environment to create")
    p.add_argument("--isa", default="auto", help="auto (this CPU's widest), avx512 or avx2")
    p.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION, help="llama-cpp-python's version")
    p.add_argument("--print-cmake-args", action="store_true", help="print the CMake options and stop")
    a = p.parse_args(argv)
    if a.print_cmake_args:
        print(" ".join(llamacpp_cmake_args(cpu_flags(), a.isa)))
        return
    print(f"building llama-cpp-python {a.version} for {peer_isa(cpu_flags(), a.isa)} into {a.out} "
          "(minutes: llama.cpp compiles from source) ...", flush=True)
    py = build_llamacpp_env(a.out, a.isa, a.version)
    print(f"done: draftwise bench --peer-python llamacpp={py} --methods ar,llamacpp ...")
