"""A stand-in for llama.cpp's `llama-server` in tests: it takes the real one's flags, answers
`/health`, `/v1/chat/completions` (a fixed reply per prompt, with llama-server's `timings`
object) and `/completion` (one token after a prompt of token ids), and misbehaves on demand: FAKE_LLAMA_SERVER_DIE_AT=N exits at the Nth chat request
(a crash mid-run), FAKE_LLAMA_SERVER_HANG_AT=N never answers it, FAKE_LLAMA_SERVER_FAIL_START=1
exits before it listens. FAKE_LLAMA_SERVER_ARGS=FILE records its command line."""
import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser()
p.add_argument("-m")
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, default=8080)
p.add_argument("--spec-type", default="none")
p.add_argument("--version", action="store_true")
a, _ = p.parse_known_args()
if a.version:
    print("version: 0 (fake)")
    sys.exit(0)
if os.environ.get("FAKE_LLAMA_SERVER_ARGS"):
    with open(os.environ["FAKE_LLAMA_SERVER_ARGS"], "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\n")
if os.environ.get("FAKE_LLAMA_SERVER_FAIL_START"):
    print("error: failed to load model (fake)", file=sys.stderr)
    sys.exit(1)
die_at = int(os.environ.get("FAKE_LLAMA_SERVER_DIE_AT", "0"))
hang_at = int(os.environ.get("FAKE_LLAMA_SERVER_HANG_AT", "0"))
count = [0]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _json(self, obj, status=200):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._json({"status": "ok"} if self.path == "/health" else {"error": "not found"},
                   200 if self.path == "/health" else 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        count[0] += 1
        if count[0] == die_at:
            os._exit(3)
        if count[0] == hang_at:
            time.sleep(3600)
        if self.path == "/completion":           # raw token prompt, one new token (a prefill)
            return self._json({"content": " x", "timings": {"prompt_n": len(body["prompt"]), "prompt_ms": 1.0,
                                                             "predicted_n": 1, "predicted_ms": 1.0}})
        last = body["messages"][-1]["content"]
        reply = " ".join(last.split()[:3]) + " done"
        n = len(reply.split())
        drafted = 4 if a.spec_type != "none" else 0
        self._json({"choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                 "finish_reason": "stop"}],
                    "timings": {"prompt_n": 5, "prompt_ms": 2.0, "predicted_n": n, "predicted_ms": 10.0 * n,
                                "draft_n": drafted, "draft_n_accepted": drafted // 2}})


ThreadingHTTPServer((a.host, a.port), Handler).serve_forever()
