"""`draftwise bench load`: the load test (bench/load.py) against a running server, or, with
`--soak` / `--bad-input`, the soak and bad-input runs (bench/soak.py) built on it."""
from __future__ import annotations

import argparse
import json
import sys

from draftwise.bench.load import __doc__ as load_doc
from draftwise.bench.load import _is_loopback, format_results, run_load_test
from draftwise.bench.datasets import load_prompts
from draftwise.bench.soak import format_bad_inputs, format_soak, run_bad_inputs, run_soak


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="draftwise bench load", description=load_doc.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="default: the first id of /v1/models")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--chat", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--allow-remote", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--turns", type=int, default=1, help="chat: user turns per session (multi-turn)")
    ap.add_argument("--dataset", default=None,
                    help="prompts for the sessions: a question.jsonl path (MT-bench / Spec-Bench), or code-edits, "
                         "sharegpt, humaneval, json-schema")
    ap.add_argument("--settle", type=float, default=1.5,
                    help="seconds to wait before reading the server's counters after the run (replicas "
                         "behind a router report every second; default: 1.5)")
    ap.add_argument("--bad-input", action="store_true",
                    help="send the bad-input catalogue beside well-formed streams (draftwise/bench/soak.py)")
    ap.add_argument("--soak", action="store_true",
                    help="start a server (arguments after '--' go to `draftwise serve`) and report RSS fresh, "
                         "after the load and after bad input, and its exit time on SIGTERM")
    ap.add_argument("--server-log", default=None, help="--soak: file for the server's log")
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1:]
    a = ap.parse_args(argv)
    if a.soak:
        res = run_soak(serve_args, a.num_requests, a.concurrency, a.max_tokens, log_path=a.server_log)
        print(json.dumps(res, indent=2) if a.json else format_soak(res))
        return
    if a.bad_input:
        if not a.allow_remote and not _is_loopback(a.url):
            raise SystemExit(f"{a.url} is not a loopback address (pass --allow-remote)")
        res = run_bad_inputs(a.url, a.model)
        print(json.dumps(res, indent=2) if a.json else format_bad_inputs(res))
        return
    prompts = None
    if a.dataset:
        prompts = load_prompts(a.dataset, None)
    res = run_load_test(a.url, a.num_requests, a.concurrency, a.max_tokens, prompts=prompts, model=a.model,
                        api_key=a.api_key, stream=not a.no_stream, chat=a.chat, temperature=a.temperature,
                        allow_remote=a.allow_remote, turns=a.turns, settle_s=a.settle)
    print(json.dumps(res, indent=2) if a.json else format_results(res))


if __name__ == "__main__":
    main()
