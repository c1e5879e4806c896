"""Export the weights draftwise runs to an OpenVINO model for the `openvino` / `openvino-pld` bench peers.

    python -m draftwise.bench.openvino_export --weights int4 --out ov-smollm2-int4

The source is draftwise's own dequantized copy of the model (for the packaged SmolLM2: the Q4_1
GGUF converted to a Hugging Face directory under ~/.cache/draftwise/models), so every engine in a
bench run starts from the same weights. OpenVINO then compresses them again with NNCF: `int8`
(per channel) or `int4` (asymmetric, group 32, every linear; NNCF keeps the embedding and LM head in
int8), the formats OpenVINO GenAI serves fastest on CPUs. The OpenVINO tokenizer / detokenizer
models are written beside it.

Needs optimum-intel with its OpenVINO and NNCF extras, which pin transformers versions of their own:
run it in a separate environment (`pip install "optimum-intel[openvino]" nncf`) with draftwise
importable, or pass --source to a directory that environment can read."""
from __future__ import annotations

import argparse
import json
import os
import time

from draftwise.models.loader import resolve_model_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                   help="what draftwise loads (its dequantized directory is exported)")
    p.add_argument("--source", default=None, help="a Hugging Face directory to export instead of --model's")
    p.add_argument("--weights", choices=["int8", "int4"], default="int4")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    try:
        import openvino as ov
        from openvino_tokenizers import convert_tokenizer
        from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig
        from transformers import AutoTokenizer
    except ImportError as e:
        raise SystemExit(f"openvino_export needs optimum-intel with OpenVINO and NNCF ({e})") from None
    src = a.source
    if src is None:
        src = resolve_model_dir(a.model)
    t0 = time.perf_counter()
    bits = 4 if a.weights == "int4" else 8
    q = OVWeightQuantizationConfig(bits=bits, group_size=32 if bits == 4 else -1, ratio=1.0, sym=False)
    OVModelForCausalLM.from_pretrained(src, export=True, quantization_config=q).save_pretrained(a.out)
    tok = AutoTokenizer.from_pretrained(src)
    tok.save_pretrained(a.out)
    ov_tok, ov_detok = convert_tokenizer(tok, with_detokenizer=True)
    ov.save_model(ov_tok, os.path.join(a.out, "openvino_tokenizer.xml"))
    ov.save_model(ov_detok, os.path.join(a.out, "openvino_detokenizer.xml"))
    with open(os.path.join(a.out, "draftwise_export.json"), "w") as f:
        json.dump({"source": src, "weights": a.weights, "group_size": 32 if bits == 4 else None}, f, indent=1)
    print(f"exported {src} -> {a.out} ({a.weights}) in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
