"""Packaged models by short name: chunks from installed packages assembled once into the cache and
checked against the pinned size and SHA-256; a missing package names the pip install."""
import hashlib
import os
import sys

import pytest

from draftwise.models import packaged as P


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    data = [os.urandom(1000), os.urandom(777)]
    for i, blob in enumerate(data, 1):
        pkg = tmp_path / "site" / f"dw_fake_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    whole = b"".join(data)
    model = P.PackagedModel("fake-0.1b", "fake.gguf", P._chunks("dw_fake_part", 2), "pip install dw-fake-part1 dw-fake-part2",
                            size=len(whole), sha256=hashlib.sha256(whole).hexdigest(), aliases=("Org/Fake",))
    monkeypatch.setitem(P._BY_ALIAS, "fake-0.1b", model)
    monkeypatch.setitem(P._BY_ALIAS, "Org/Fake", model)
    return model, whole, tmp_path / "cache"


def test_chunks_are_assembled_once_and_verified(chunked):
    model, whole, cache = chunked
    path = P.packaged_gguf("Org/Fake", str(cache))
    assert open(path, "rb").read() == whole and os.path.exists(path + ".verified")
    mtime = os.path.getmtime(path)
    assert P.packaged_gguf("fake-0.1b", str(cache)) == path and os.path.getmtime(path) == mtime


def test_a_corrupt_chunk_is_refused(chunked, monkeypatch):
    model, whole, cache = chunked
    monkeypatch.setitem(P._BY_ALIAS, "fake-0.1b", P.PackagedModel(**{**model.__dict__, "sha256": "0" * 64}))
    with pytest.raises(ValueError, match="not the pinned"):
        P.packaged_gguf("fake-0.1b", str(cache))
    assert not os.path.exists(os.path.join(cache, "packaged", "fake.gguf"))


def test_a_missing_package_names_the_install(tmp_path, monkeypatch):
    model = P.PackagedModel("absent", "absent.gguf", (("dw_not_installed_pkg", "x.gguf"),), "pip install dw-absent")
    monkeypatch.setitem(P._BY_ALIAS, "absent", model)
    with pytest.raises(ValueError, match="pip install dw-absent"):
        P.packaged_gguf("absent", str(tmp_path))
    assert "dw_not_installed_pkg" not in sys.modules


def test_every_packaged_model_pins_its_assembly():
    for m in P.PACKAGED.values():
        assert m.license and m.pip.startswith("pip install")
        if len(m.parts) > 1:
            assert m.size and len(m.sha256) == 64


def test_cache_command_lists_and_clears(tmp_path, monkeypatch, capsys):
    from draftwise.entrypoints.cli import main
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path))
    (tmp_path / "packaged").mkdir()
    (tmp_path / "packaged" / "m.gguf").write_bytes(b"x" * 2_000_000)
    (tmp_path / "step_costs").mkdir()
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "2.0 MB  packaged" in out and "step_costs" in out
    assert main(["cache", "clear", "--what", "missing"]) == 2
    assert main(["cache", "clear", "--what", "packaged"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["step_costs"]
