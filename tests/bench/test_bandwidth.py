"""Plain decoding beside the machine's memory limit: bandwidth, bytes per step, each method's share."""
from draftwise.bench.bandwidth import WeightStream, gguf_bytes_per_token, is_plain, read_bandwidth_gbs
from tests.models.gguf_builder import write_tiny_llama_gguf


def test_bytes_per_step_leave_out_an_untied_embedding(tmp_path):
    from gguf import GGUFReader
    tied = write_tiny_llama_gguf(str(tmp_path / "tied.gguf"), {"attn_q": "Q4_K", "ffn_down": "Q6_K"})
    untied = write_tiny_llama_gguf(str(tmp_path / "untied.gguf"), {"attn_q": "Q4_K", "output": "Q8_0"})
    sizes = {p: {t.name: int(t.n_bytes) for t in GGUFReader(p).tensors} for p in (tied, untied)}
    assert "output.weight" not in sizes[tied] and "output.weight" in sizes[untied]
    assert gguf_bytes_per_token(tied) == sum(sizes[tied].values())
    assert gguf_bytes_per_token(untied) == sum(sizes[untied].values()) - sizes[untied]["token_embd.weight"]


def test_each_plain_method_is_a_share_of_the_higher_bandwidth():
    stream = WeightStream(bytes_per_token=2_000_000_000, bandwidth_before_gbs=40.0, bandwidth_after_gbs=50.0)
    results = [
        {"method": "ar", "spec": None, "quantization": "gguf", "decode_tokens_per_s": 20.0},
        {"method": "ar@int4", "spec": None, "quantization": "int4", "decode_tokens_per_s": 30.0},
        {"method": "auto", "spec": {"method": "suffix"}, "quantization": "gguf", "decode_tokens_per_s": 60.0},
        {"method": "llamacpp", "spec": "llamacpp", "decode_tokens_per_s": 15.0},
        {"method": "llamacpp-pld", "spec": "llamacpp-pld", "decode_tokens_per_s": 30.0},
        {"method": "openvino", "spec": "openvino", "error": "could not run"},
    ]
    assert [is_plain(r) for r in results] == [True, False, False, True, False, True]
    md = stream.markdown(results, threads=2)
    assert "40.0 GB/s before the run, 50.0 after" in md and "2.000 GB" in md
    # 20 tokens/s x 2 GB = 40 GB/s, 80 % of 50; llama.cpp 30 GB/s, 60 %; the rest are not plain or failed
    assert "ar 40.0 GB/s (80%), llamacpp 30.0 GB/s (60%)." in md
    assert "auto" not in md and "int4" not in md and "openvino" not in md
    assert "Weights read" not in WeightStream(None, 40.0, 50.0).markdown(results, threads=2)


def test_read_bandwidth_is_a_positive_rate():
    assert read_bandwidth_gbs(nbytes=1 << 20, repeats=2) > 0
