"""A Hugging Face Hub served on 127.0.0.1 for tests: the part of the Hub's HTTP API that
`huggingface_hub` calls to list and fetch a model repository, over repositories made of local files.

- `GET /api/models/<repo>[/revision/<rev>]`: model info, `sha` and `siblings` (with sizes);
- `GET /api/models/<repo>/tree/<rev>[/<path>]`: the file listing; `POST .../paths-info/<rev>`;
- `HEAD` / `GET /<repo>/resolve/<rev>/<file>`: `ETag`, `X-Repo-Commit`, `Content-Length`, `Range`;
- errors as the Hub sends them: 404 with `X-Error-Code: RepoNotFound` / `EntryNotFound` /
  `RevisionNotFound`, 401 with `GatedRepo` for a gated repo without the right token.

`requests` records every request (method, path, Range) so tests can assert what was fetched;
`cut_after[file] = (n, k)` closes the connection of that file's next k body GETs once the file's
first n bytes are sent (a network that goes away midway, k times); `delay_s` slows every file body (two processes racing for one file)."""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    files: dict[str, str]                      # path in the repo -> local file
    sha: str = ""
    gated_token: str | None = None             # a token that may read it (None: public)

    def __post_init__(self):
        if not self.sha:
            h = hashlib.sha1(json.dumps(sorted((k, os.path.getsize(v)) for k, v in self.files.items())).encode())
            self.sha = h.hexdigest()


@dataclass
class LocalHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    cut_after: dict[str, tuple[int, int]] = field(default_factory=dict)
    delay_s: float = 0.0

    def start(self) -> "LocalHub":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

            def do_POST(self):
                hub._handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fetched(self, repo: str) -> list[str]:
        """The files of `repo` whose bodies were requested (GET on resolve, not a read of the first
        bytes alone: `bytes=0-N`), in order."""
        prefix = f"/{repo}/resolve/"
        return [p[len(prefix):].split("/", 1)[1] for m, p, r in self.requests
                if m == "GET" and p.startswith(prefix) and (r is None or not r.startswith("bytes=0-"))]

    # --- the API ---------------------------------------------------------------------------------
    def _find(self, parts: list[str]) -> tuple[str, Repo, list[str]] | None:
        if len(parts) >= 2 and "/".join(parts[:2]) in self.repos:
            name = "/".join(parts[:2])
            return name, self.repos[name], parts[2:]
        return None

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        self.requests.append((h.command, path, h.headers.get("Range")))
        if h.command == "POST":
            n = int(h.headers.get("Content-Length") or 0)
            h.rfile.read(n)
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "models"]:
            found = self._find(parts[2:])
            if found is None:
                return self._error(h, 404, "RepoNotFound", "Repository not found")
            name, repo, rest = found
            if not self._allowed(h, repo):
                return self._error(h, 401, "GatedRepo", "Access to this model is restricted")
            rev = None
            if rest[:1] in (["revision"], ["tree"], ["paths-info"]):
                rev = rest[1] if len(rest) > 1 else "main"
            if rev is not None and rev not in ("main", repo.sha):
                return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
            if rest[:1] == ["tree"] or rest[:1] == ["paths-info"]:
                items = [{"type": "file", "path": f, "size": os.path.getsize(p), "oid": _etag(p)}
                         for f, p in sorted(repo.files.items())]
                return self._json(h, items, head)
            info = {"_id": name, "id": name, "modelId": name, "sha": repo.sha, "private": False,
                    "gated": "manual" if repo.gated_token else False, "disabled": False, "tags": [],
                    "siblings": [{"rfilename": f, "size": os.path.getsize(p), "blobId": _etag(p)}
                                 for f, p in sorted(repo.files.items())]}
            return self._json(h, info, head)
        found = self._find(parts)
        if found is None or len(found[2]) < 3 or found[2][0] != "resolve":
            return self._error(h, 404, "RepoNotFound", "Repository not found")
        name, repo, rest = found
        if not self._allowed(h, repo):
            return self._error(h, 401, "GatedRepo", "Access to this model is restricted")
        rev, file = rest[1], "/".join(rest[2:])
        if rev not in ("main", repo.sha):
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if file not in repo.files:
            return self._error(h, 404, "EntryNotFound", f"{file} does not exist")
        self._file(h, repo, file, head)

    def _allowed(self, h, repo: Repo) -> bool:
        return repo.gated_token is None or h.headers.get("Authorization") == f"Bearer {repo.gated_token}"

    def _file(self, h, repo: Repo, file: str, head: bool) -> None:
        local = repo.files[file]
        size = os.path.getsize(local)
        start, end = 0, size - 1
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[len("bytes="):].partition("-")
            start = int(a) if a else 0
            end = min(int(b), size - 1) if b else size - 1
        status = 206 if rng and not head else 200
        h.send_response(status)
        h.send_header("ETag", f'"{_etag(local)}"')
        h.send_header("X-Repo-Commit", repo.sha)
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Type", "application/octet-stream")
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        h.send_header("Content-Length", str(end - start + 1 if status == 206 else size))
        h.end_headers()
        if head:
            return
        with open(local, "rb") as f:
            f.seek(start)
            body = f.read(end - start + 1)
        cut = self.cut_after.get(file) if not (rng or "").startswith("bytes=0-") else None
        if cut is not None:
            self.cut_after[file] = (cut[0], cut[1] - 1)
            if cut[1] <= 1:
                del self.cut_after[file]
        if self.delay_s:
            time.sleep(self.delay_s)
        if cut is not None:
            h.wfile.write(body[:max(0, cut[0] - start)])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)
            return
        h.wfile.write(body)

    def _json(self, h, obj, head: bool) -> None:
        data = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if not head:
            h.wfile.write(data)

    def _error(self, h, status: int, code: str, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)


_ETAGS: dict[tuple[str, int, float], str] = {}


def _etag(path: str) -> str:
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime)
    if key not in _ETAGS:
        with open(path, "rb") as f:
            _ETAGS[key] = hashlib.sha256(f.read()).hexdigest()
    return _ETAGS[key]
