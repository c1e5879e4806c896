"""Each GGUF block family decodes to group-affine codes whose dequantization equals gguf.quants'
bit for bit, on random blocks (every byte random, the fp16 scales finite)."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGML_QUANT_SIZES
from gguf.quants import dequantize

from draftwise.formats import FORMATS, UnsupportedFormat, block_format, decode, supported_types
from draftwise.formats.dense import read_dense

# byte offsets of each type's fp16 scales in its block (kept finite in random blocks)
F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q2_K": [80, 82],
              "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0]}


def random_blocks(name: str, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    fmt = FORMATS[name]
    b = rng.integers(0, 256, size=(n, fmt.type_size), dtype=np.uint8)
    for off in F16_FIELDS[name]:
        # finite fp16 values over a wide range, subnormals and zero included
        h = (rng.standard_normal(n) * 10.0 ** rng.uniform(-7, 2, n)).astype(np.float16)
        h[:3] = [0.0, 6e-8, -1e-5]
        b[:, off:off + 2] = h.view(np.uint8).reshape(n, 2)
    return b


def test_every_required_type_is_registered():
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                 "Q6_K", "IQ4_NL", "IQ4_XS"):
        assert name in supported_types()
    for name, fmt in FORMATS.items():
        bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        assert (fmt.block_size, fmt.type_size) == (bs, ts), name


@pytest.mark.parametrize("name", sorted(F16_FIELDS))
def test_decode_equals_gguf_dequantize_bit_for_bit(name):
    fmt = FORMATS[name]
    N, per_row = 24, 2
    raw = random_blocks(name, N * per_row, seed=len(name))
    K = per_row * fmt.block_size
    ga = decode(name, raw, (N, K))
    want = dequantize(raw.reshape(N, -1), GGMLQuantizationType[name]).reshape(N, K).astype(np.float32)
    got = ga.dequantize().numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # the codes are what the kernels expect
    if fmt.bits in (4, 5):
        assert ga.codes.dtype == torch.uint8 and int(ga.codes.max()) < 2 ** fmt.bits
    else:
        assert ga.codes.dtype == torch.int8
    assert ga.scale.shape == (N, K // fmt.group)
    # a lookup of some rows equals those rows of the whole
    ids = torch.tensor([3, 0, 17, 3])
    assert torch.equal(ga.rows(ids), ga.dequantize()[ids])


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_dense_types_read_exactly(name):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    if name == "F16":
        raw, want = x.astype(np.float16).view(np.uint8), x.astype(np.float16).astype(np.float32)
    elif name == "BF16":
        t = torch.from_numpy(x).to(torch.bfloat16)
        raw, want = t.view(torch.int16).numpy().view(np.uint8), t.float().numpy()
    else:
        raw, want = x.view(np.uint8), x
    np.testing.assert_array_equal(read_dense(name, raw, (5, 8)).numpy(), want)


def test_unsupported_type_is_refused_by_name():
    with pytest.raises(UnsupportedFormat, match="IQ2_XXS is not supported"):
        block_format("IQ2_XXS")


def test_columns_not_a_whole_number_of_blocks_are_refused():
    with pytest.raises(ValueError, match="blocks of 256"):
        decode("Q4_K", np.zeros(144, np.uint8), (1, 128))


def test_blocks_cut_from_real_files_decode_exactly():
    """Four blocks of each type from files llama.cpp's quantizer wrote (llama-cpp-python 0.3.36 from
    SmolLM2-135M's Q4_1 file: fixtures/real_blocks.npz); the decode equals gguf's bit for bit."""
    import os
    fixtures = np.load(os.path.join(os.path.dirname(__file__), "fixtures", "real_blocks.npz"))
    assert len(fixtures.files) >= 11
    for name in fixtures.files:
        raw = fixtures[name]
        fmt = FORMATS[name]
        n = raw.size // fmt.type_size
        want = dequantize(raw.reshape(1, -1), GGMLQuantizationType[name]).reshape(1, -1).astype(np.float32)
        got = decode(name, raw, (1, n * fmt.block_size)).dequantize().numpy()
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
