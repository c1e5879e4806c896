"""The Hugging Face Hub, through `huggingface_hub`: list a repository's files, fetch some of them
into the standard cache, peek at a GGUF's header before fetching gigabytes.

Everything goes through the library rather than a client of our own, so the conventions people
already rely on hold: the shared cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else
`~/.cache/huggingface/hub`, laid out as `models--org--name/snapshots/<sha>/`, so a file fetched by
transformers, vLLM or llama.cpp is not fetched again), `HF_TOKEN`, `HF_ENDPOINT`, `HF_HUB_OFFLINE=1`,
downloads that resume where a cut connection left them (within a run: huggingface_hub 2.x keeps a
run's partial file private to that run), a file lock per blob (two processes starting at once fetch a file once) and one progress bar per file.
These variables are read on every call, not once at import, so one process can switch between a
hub and its cache.

Every failure becomes a `HubError`: one line naming the repository and what to do (accept a licence
and set HF_TOKEN, `draftwise pull` while online, free disk, ...), never the library's traceback."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import struct
import sys
import warnings
from dataclasses import dataclass

DEFAULT_ENDPOINT = "https://huggingface.co"
CONNECT_TIMEOUT_S = 10.0          # a machine without a network fails in seconds, not minutes
NO_SPACE_WARNING = "Not enough free disk space"   # huggingface_hub's warning before a file that will not fit
HEADER_BYTES = 1 << 16            # a GGUF's architecture key sits in its first few hundred bytes


class HubError(ValueError):
    """A hub name that could not be resolved or fetched; the message is one line for the user."""


@dataclass(frozen=True)
class HubOptions:
    """How to reach the Hub for one name: `revision` (a branch, tag or commit; None: main), `token`
    (None: HF_TOKEN or the saved login), `offline` (the cache only, as HF_HUB_OFFLINE=1), `quiet`
    (no progress bars; they are shown only on a terminal anyway)."""
    revision: str | None = None
    token: str | None = None
    offline: bool = False
    quiet: bool = False


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "").strip().rstrip("/") or DEFAULT_ENDPOINT


def hub_cache() -> str:
    """The standard cache folder, as huggingface_hub resolves it."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def is_offline(opts: HubOptions) -> bool:
    return opts.offline or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _token(opts: HubOptions):
    return opts.token or os.environ.get("HF_TOKEN") or None


def repo_folder(repo: str) -> str:
    return os.path.join(hub_cache(), "models--" + repo.replace("/", "--"))


def not_cached(repo: str, what: str = "") -> HubError:
    return HubError(f"{repo}{'/' + what if what else ''} is not in the Hugging Face cache ({hub_cache()}) and the "
                    f"hub is off (--offline / HF_HUB_OFFLINE=1): fetch it once while online with `draftwise pull {repo}`")


def no_space(where: str, need_mb: float | None = None, free_mb: float | None = None) -> HubError:
    """The one line for a file that will not fit in the cache's disk."""
    need = f" (needs {need_mb:.2f} MB, {free_mb:.2f} MB free)" if need_mb is not None else ""
    return HubError(f"not enough free disk space to fetch {where} into {hub_cache()}{need}: free space (or point "
                    "HF_HUB_CACHE elsewhere), then run again")


@contextlib.contextmanager
def hub_errors(repo: str, opts: HubOptions, what: str = ""):
    """Translate huggingface_hub's and the transport's exceptions into one-line HubErrors."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RemoteEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)
    where = f"{repo}{'/' + what if what else ''}"
    try:
        yield
    except HubError:
        raise
    except GatedRepoError:
        raise HubError(f"{repo} is a gated repository: accept its licence on its Hub page, then set HF_TOKEN "
                       "(or pass --hf-token) to a token of that account") from None
    except RepositoryNotFoundError:
        raise HubError(f"no model repository {repo!r} on {endpoint()} (if it is private, set HF_TOKEN or pass "
                       "--hf-token)") from None
    except RevisionNotFoundError:
        raise HubError(f"{repo} has no revision {opts.revision!r}") from None
    except RemoteEntryNotFoundError:
        raise HubError(f"{repo} has no file {what!r}" + (f" at revision {opts.revision}" if opts.revision else "")
                       ) from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, FileNotFoundError):
        if is_offline(opts):
            raise not_cached(repo, what) from None
        raise HubError(f"cannot reach the Hugging Face Hub at {endpoint()} for {where}, and it is not cached "
                       f"({hub_cache()}); check the network or HF_ENDPOINT") from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise HubError(f"{repo}: the Hub refused access ({status}): set HF_TOKEN (or --hf-token) to a token "
                           "that may read it") from None
        raise HubError(f"{where}: the Hub answered {status or 'an error'} ({str(e).splitlines()[0][:160]})") from None
    except UserWarning as e:
        if not str(e).startswith(NO_SPACE_WARNING):
            raise
        sizes = re.findall(r"([\d.]+) MB", str(e))
        raise no_space(where, *map(float, sizes)) if len(sizes) == 2 else no_space(where) from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise HubError(f"the disk is full while fetching {where} into {hub_cache()}: free space (or point "
                           "HF_HUB_CACHE elsewhere), then run again") from None
        raise HubError(f"{where}: {type(e).__name__}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the transport's own errors (connection refused, timeouts, cuts)
        if type(e).__module__.split(".")[0].startswith("httpx") or isinstance(e, (ConnectionError, TimeoutError)):
            raise HubError(f"cannot reach the Hugging Face Hub at {endpoint()} for {where} ({type(e).__name__}: "
                           f"{str(e)[:160]}); run again to retry") from None
        raise


@contextlib.contextmanager
def _progress(opts: HubOptions):
    """huggingface_hub's per-file progress bars only on a terminal and without --quiet. Its own
    log lines (a retried chunk, ...) stay quiet: what failed reaches the user as one HubError."""
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    show = not opts.quiet and sys.stderr.isatty()
    was_disabled = are_progress_bars_disabled()
    (enable_progress_bars if show else disable_progress_bars)()
    try:
        yield
    finally:
        (disable_progress_bars if was_disabled else enable_progress_bars)()


def _cached_snapshot(repo: str, revision: str | None) -> str | None:
    folder = repo_folder(repo)
    rev = revision or "main"
    sha = rev if len(rev) == 40 and all(c in "0123456789abcdef" for c in rev) else None
    if sha is None:
        try:
            with open(os.path.join(folder, "refs", rev)) as f:
                sha = f.read().strip()
        except OSError:
            return None
    snap = os.path.join(folder, "snapshots", sha)
    return snap if os.path.isdir(snap) else None


def repo_files(repo: str, opts: HubOptions) -> dict[str, int | None]:
    """{path in the repo: size in bytes (None: unknown)}: from the Hub, or offline from the cached
    snapshot of the revision (the files fetched before, which is all an offline run can load)."""
    if is_offline(opts):
        snap = _cached_snapshot(repo, opts.revision)
        if snap is None:
            raise not_cached(repo)
        out = {}
        for d, _, names in os.walk(snap):
            for n in names:
                p = os.path.join(d, n)
                out[os.path.relpath(p, snap).replace(os.sep, "/")] = os.path.getsize(p)
        return out
    from huggingface_hub import HfApi
    with hub_errors(repo, opts):
        info = HfApi(endpoint=endpoint(), token=_token(opts)).model_info(
            repo, revision=opts.revision, files_metadata=True, timeout=CONNECT_TIMEOUT_S)
    return {s.rfilename: s.size for s in (info.siblings or [])}


def fetch(repo: str, files: list[str], opts: HubOptions) -> list[str]:
    """Local paths of `files` from `repo` at the options' revision, fetched into the standard cache
    where missing (resumed where a previous run was cut off: fetch_blob), in the given order."""
    from huggingface_hub import hf_hub_download
    paths = []
    with _progress(opts):
        for f in files:
            if not is_offline(opts):
                with hub_errors(repo, opts, f):
                    fetch_blob(repo, f, opts)
            # huggingface_hub warns that a file will not fit, then writes until the disk is full:
            # its warning, made an error, stops the fetch before the first byte
            with hub_errors(repo, opts, f), warnings.catch_warnings():
                warnings.filterwarnings("error", message=NO_SPACE_WARNING, category=UserWarning)
                paths.append(hf_hub_download(repo, f, revision=opts.revision, token=_token(opts),
                                             endpoint=endpoint(), cache_dir=hub_cache(),
                                             local_files_only=is_offline(opts), etag_timeout=CONNECT_TIMEOUT_S))
    return paths


DOWNLOAD_TRIES = 5                # body requests per file and run, each resuming where the last stopped
PARTIAL_SUFFIX = ".draftwise-partial"


def fetch_blob(repo: str, filename: str, opts: HubOptions) -> None:
    """The file's blob (`blobs/<etag>` of the repo's cache folder), fetched where neither it nor
    the revision's pointer to it is cached, into `<etag>.draftwise-partial` resumed by HTTP Range
    from what an earlier try or run left there (huggingface_hub 2.x deletes a cut run's partial
    file, so the next run would start over), then renamed into place; hf_hub_download then only
    links it into the snapshot. Under huggingface_hub's own per-blob lock: two processes fetch a
    file once. A file whose every try of this run is cut raises; its bytes stay for the next run."""
    import httpx
    from filelock import FileLock
    from huggingface_hub import get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.utils import build_hf_headers
    if isinstance(try_to_load_from_cache(repo, filename, cache_dir=hub_cache(), revision=opts.revision), str):
        return
    url = hf_hub_url(repo, filename, revision=opts.revision, endpoint=endpoint())
    meta = get_hf_file_metadata(url, token=_token(opts), timeout=CONNECT_TIMEOUT_S)
    if meta.etag is None or meta.size is None:
        return                         # huggingface_hub's own path decides
    blob = os.path.join(repo_folder(repo), "blobs", meta.etag)
    lock = os.path.join(hub_cache(), ".locks", os.path.basename(repo_folder(repo)), f"{meta.etag}.lock")
    os.makedirs(os.path.dirname(blob), exist_ok=True)
    os.makedirs(os.path.dirname(lock), exist_ok=True)
    partial = blob + PARTIAL_SUFFIX
    headers = build_hf_headers(token=_token(opts))
    with FileLock(lock):
        if os.path.exists(blob):
            return
        if os.path.exists(partial) and os.path.getsize(partial) > meta.size:
            os.remove(partial)         # not this file's bytes (the upstream file changed under one etag)
        have = os.path.getsize(partial) if os.path.exists(partial) else 0
        free = shutil.disk_usage(os.path.dirname(partial)).free
        if free < meta.size - have:
            raise no_space(f"{repo}/{filename}", (meta.size - have) / 1e6, free / 1e6)
        for _ in range(DOWNLOAD_TRIES):
            have = os.path.getsize(partial) if os.path.exists(partial) else 0
            if have >= meta.size:
                break
            try:
                _stream_into(partial, meta.location or url, headers, have, filename)
            except (httpx.TransportError, ConnectionError, TimeoutError):
                continue
        got = os.path.getsize(partial) if os.path.exists(partial) else 0
        if got != meta.size:
            raise HubError(f"{repo}/{filename}: the download was cut {DOWNLOAD_TRIES} times ({got / 1e6:.1f} of "
                           f"{meta.size / 1e6:.1f} MB kept in {hub_cache()}); run again to resume")
        os.replace(partial, blob)


def _stream_into(path: str, url: str, headers: dict, have: int, name: str) -> None:
    """The body of `url` from byte `have` on, appended to `path` (from the start where the server
    does not honour the range)."""
    import httpx
    from huggingface_hub.utils import hf_raise_for_status
    from huggingface_hub.utils import tqdm as hf_tqdm
    rng = {"Range": f"bytes={have}-"} if have else {}
    timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=60.0)
    with httpx.Client(follow_redirects=True, timeout=timeout) as client, \
            client.stream("GET", url, headers={**headers, **rng}) as r:
        if r.status_code >= 400:
            r.read()
            hf_raise_for_status(r)
        start = have if r.status_code == 206 else 0
        total = start + int(r.headers.get("Content-Length", 0)) or None
        # huggingface_hub's bar: shown or hidden as _progress set it for the run
        with open(path, "ab" if start else "wb") as f, \
                hf_tqdm(total=total, initial=start, unit="B", unit_scale=True, desc=os.path.basename(name)) as bar:
            for chunk in r.iter_bytes():           # as received: a cut keeps every byte that came
                f.write(chunk)
                bar.update(len(chunk))


def read_head(repo: str, filename: str, opts: HubOptions, n: int = HEADER_BYTES) -> bytes | None:
    """The first `n` bytes of a file on the Hub (a Range request) - None offline or where the
    server ignores ranges, so the caller simply fetches the file."""
    if is_offline(opts):
        return None
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session
    url = hf_hub_url(repo, filename, revision=opts.revision, endpoint=endpoint())
    with hub_errors(repo, opts, filename):
        r = get_session().get(url, headers={**build_hf_headers(token=_token(opts)), "Range": f"bytes=0-{n - 1}"},
                              follow_redirects=True, timeout=CONNECT_TIMEOUT_S)
        if r.status_code != 206:
            return None
        return bytes(r.content[:n])


def gguf_architecture(head: bytes) -> str | None:
    """`general.architecture` from the first bytes of a GGUF file (None when they hold no such key
    or are not a GGUF): read to refuse an architecture draftwise does not run before the download."""
    if len(head) < 24 or head[:4] != b"GGUF":
        return None
    pos, (n_kv,) = 24, struct.unpack_from("<Q", head, 16)
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
    try:
        for _ in range(min(n_kv, 4096)):
            (klen,) = struct.unpack_from("<Q", head, pos)
            key = head[pos + 8:pos + 8 + klen].decode("utf-8", "replace")
            pos += 8 + klen
            (vtype,) = struct.unpack_from("<I", head, pos)
            pos += 4
            if vtype == 8:                                   # a string
                (slen,) = struct.unpack_from("<Q", head, pos)
                value = head[pos + 8:pos + 8 + slen].decode("utf-8", "replace")
                if key == "general.architecture":
                    return value
                pos += 8 + slen
            elif vtype in sizes:
                pos += sizes[vtype]
            else:                                            # an array: stop (the key comes first in practice)
                return None
    except struct.error:
        return None
    return None
