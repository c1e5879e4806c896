"""The llama.cpp peer's build options: named instruction sets, never the native build, AMX off."""
import pytest

from draftwise.bench.build_peer import build_llamacpp_env, llamacpp_cmake_args, peer_isa

AMX_CPU = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
           "amx_tile", "amx_int8", "amx_bf16"}
ZEN3 = {"avx2", "fma", "f16c"}


def test_auto_is_the_widest_the_cpu_runs():
    assert peer_isa(AMX_CPU, "auto") == "avx512"
    assert peer_isa(ZEN3, "auto") == "avx2"
    assert peer_isa(AMX_CPU, "avx2") == "avx2"


def test_avx512_build_keeps_amx_off_and_names_what_the_cpu_has():
    args = llamacpp_cmake_args(AMX_CPU, "auto")
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX512=ON" in args
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
    assert "-DGGML_AVX512_VNNI=ON" in args and "-DGGML_AVX512_BF16=ON" in args
    no_bf16 = llamacpp_cmake_args(AMX_CPU - {"avx512_bf16"}, "avx512")
    assert "-DGGML_AVX512_BF16=OFF" in no_bf16


def test_avx2_build_has_no_avx512():
    args = llamacpp_cmake_args(AMX_CPU, "avx2")
    assert "-DGGML_AVX512=OFF" in args and "-DGGML_AVX2=ON" in args and "-DGGML_NATIVE=OFF" in args
    assert not any(a.endswith("=ON") and "AVX512" in a for a in args)


def test_impossible_builds_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="lacks AVX-512"):
        llamacpp_cmake_args(ZEN3, "avx512")
    with pytest.raises(ValueError, match="lacks AVX2"):
        peer_isa({"sse4_2"}, "auto")
    with pytest.raises(ValueError, match="--isa"):
        peer_isa(AMX_CPU, "neon")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    with pytest.raises(ValueError, match="already holds"):
        build_llamacpp_env(str(tmp_path), "avx2", flags=ZEN3)
