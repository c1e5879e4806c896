import atexit
import os
import shutil
import tempfile

import pytest
import torch

from draftwise.config import cache_dir
from tests.helpers import make_tiny_hf

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def _private_cache() -> str:
    """A draftwise cache folder for this test process, removed at its exit: the hundreds of tiny
    models the tests write (their metadata folders, measured step costs) stay out of the user's
    cache. The assembled packaged models and their re-quantizations are shared with the user's
    cache (assembling the 1.5B's 22 packages takes minutes; the slow tests read them)."""
    user = cache_dir()
    mine = tempfile.mkdtemp(prefix="draftwise-test-cache-")
    for shared in ("packaged", "requantized"):
        os.makedirs(os.path.join(user, shared), exist_ok=True)
        os.symlink(os.path.join(user, shared), os.path.join(mine, shared))
    atexit.register(shutil.rmtree, mine, True)
    return mine


os.environ["DRAFTWISE_CACHE"] = _private_cache()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    model = make_tiny_hf(path, "llama")
    return path, model


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_qwen3"))
    model = make_tiny_hf(path, "qwen3", seed=1)
    return path, model


# The test files that serve on Ray: under pytest-xdist they run on one worker, which starts the one
# loopback cluster (pytest_collection_modifyitems keeps this list true).
RAY_FILES = {"tests/entrypoints/test_ray_serve.py", "tests/entrypoints/test_server.py",
             "tests/distributed/test_tp_ray.py"}


def pytest_collection_modifyitems(config, items):
    uses_ray = {item.nodeid.split("::", 1)[0] for item in items if "ray_cluster" in getattr(item, "fixturenames", ())}
    if not uses_ray <= RAY_FILES:
        raise pytest.UsageError(f"tests/conftest.py: add {sorted(uses_ray - RAY_FILES)} to RAY_FILES")


def pytest_xdist_make_scheduler(config, log):
    """`-n N --dist loadfile` (what CI runs): each test file on one worker (its module fixtures -
    servers, model files, references - built once), and the files of RAY_FILES together on one."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesAndRayTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "ray" if path in RAY_FILES else path
    return FilesAndRayTogether(config, log)


@pytest.fixture(scope="session")
def ray_cluster():
    """Two Ray nodes on loopback addresses, shared by every test that serves on Ray. Ray is an
    optional extra: without it these tests skip, except in CI, which installs it."""
    from tests.ray_cluster import LoopbackRayCluster, ray_available
    if not ray_available():
        if os.environ.get("CI"):
            pytest.fail("CI must install the ray extra (pip install -e '.[test,ray]')")
        pytest.skip("ray[serve] is not installed")
    with LoopbackRayCluster(num_nodes=2) as cluster:
        yield cluster
    assert not cluster.leftovers(), cluster.leftovers()      # nothing of the test outlives it


def _isas_here() -> list[str]:
    """Every kernel ISA this CPU can run, `none` (PyTorch) included."""
    from draftwise.kernels import available_isas
    return available_isas()


@pytest.fixture(params=_isas_here())
def kernel_isa(request, monkeypatch):
    """Each ISA path this machine has, forced through DRAFTWISE_ISA (the kernel state is reset
    around the test, so engines built inside it run that path)."""
    from draftwise import kernels
    monkeypatch.setenv("DRAFTWISE_ISA", request.param)
    kernels.reset()
    assert kernels.isa() == request.param
    yield request.param
    monkeypatch.delenv("DRAFTWISE_ISA")
    kernels.reset()


@pytest.fixture
def isa_kernels(kernel_isa):
    """Each compiled kernel ISA path this machine has (amx, avx512, avx2 where the CPU has them);
    `none` (PyTorch's kernels, eager layers; tests/layers/test_quant.py) is skipped."""
    from draftwise import kernels
    if kernel_isa == "none":
        pytest.skip("DRAFTWISE_ISA=none runs PyTorch's kernels and eager layers")
    if kernels.load() is None:
        # CI has a compiler: a kernel that does not build there is a failure, not a skip
        if os.environ.get("CI"):
            pytest.fail(f"the {kernel_isa} kernels did not build (see the warning above)")
        pytest.skip(f"the {kernel_isa} kernels could not be built here (no compiler?)")
    return kernel_isa
