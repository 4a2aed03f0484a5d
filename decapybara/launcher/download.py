"""Weight files from the Hugging Face Hub: `decapybara download REPO [FILE ...]`, eight connections, resumable,
checked.

What it relies on of the Hub (the same URL scheme is served by mirrors, and `HF_ENDPOINT` points elsewhere):
- `GET {endpoint}/api/models/{repo}/tree/{revision}?recursive=true` lists a revision's files, a page at a time (the
  next page in the `Link` header): each file's `path` and `size`, its git blob id (`oid`), and for a file kept in
  LFS, `lfs.oid`, the SHA-256 of its bytes.
- `{endpoint}/{repo}/resolve/{revision}/{path}` serves a file; a HEAD answers `X-Linked-Size` and `X-Linked-Etag`
  (the SHA-256, quoted) for an LFS file, and redirects to a CDN, whose signed URL takes `Range` requests.
- A private or gated repository wants `Authorization: Bearer <token>` (`HF_TOKEN`); the token goes to the endpoint's
  host only, never to the CDN a redirect leads to.

How a file comes down (`download_file`): its size is cut into up to `connections` parts (each at least
`MIN_PART_BYTES`), fetched side by side by ranged GETs into `<name>.part` at their offsets. What each part has
written is recorded in `<name>.part.json` (its parts' `[start, end, done]`, the file's size and checksum), saved
after the data it counts is flushed to disk, so an interrupted download (a dropped connection, Ctrl-C, a crash)
starts again where each part stood: a connection that fails is retried from its own offset (`RETRIES` times, with
backoff) and a later run of the same command resumes the file. A server that ignores `Range` gets one connection
from the start. Once whole, the file's SHA-256 (or, for a file outside LFS, its git blob id) is checked against the
Hub's; a mismatch deletes the partial file and says so, a match moves it into place (by default the model folder
`~/.cache/decapybara/models`, where `decapybara models` and `--model NAME` find it).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import hashlib
import itertools
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from decapybara.errors import DecapybaraError

ENDPOINT_ENV = "HF_ENDPOINT"
DEFAULT_ENDPOINT = "https://huggingface.co"
TOKEN_ENVS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
CONNECTIONS = 8
MIN_PART_BYTES = 16 << 20  # a part's bytes at least: a small file takes fewer connections
CHUNK_BYTES = 256 << 10  # read from a connection at a time (a stop is seen between reads)
SAVE_EVERY_BYTES = 32 << 20  # a part's bytes between saves of the progress record (and at its end)
RETRIES = 5  # failures in a row a part's connection may have before the download stops (resumable)
BACKOFF_S = 0.25  # the wait after a part's first failure in a row, doubled after each next (at most 8 s)
TIMEOUT_S = 60.0
RETRY_CODES = (408, 429, 500, 502, 503, 504)  # statuses a part's connection tries again (with backoff)
SUFFIX = ".mcapy"


class HubError(DecapybaraError):
    """The Hub refused or failed a request, or a download did not check out; the message says what to do."""


class HttpStatusError(HubError):
    """An HTTP error status (`code`); a part's connection retries those in `RETRY_CODES` (and a CDN's 403: an
    expired link)."""

    def __init__(self, message: str, code: int, url: str) -> None:
        super().__init__(message)
        self.code, self.url = code, url  # the URL that answered it (a redirect's target: a CDN's)


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """A file of a repository's revision, as the tree lists it."""

    repo: str
    revision: str
    path: str  # within the repository
    size: int
    sha256: str | None  # LFS files: the SHA-256 of the bytes
    git_oid: str | None  # the git blob id (SHA-1 of "blob <size>\\0" + bytes): what a file outside LFS is checked by

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


def endpoint_of(endpoint: str | None = None) -> str:
    return (endpoint or os.environ.get(ENDPOINT_ENV) or DEFAULT_ENDPOINT).rstrip("/")


def token_of(token: str | None = None) -> str | None:
    if token:
        return token
    return next((os.environ[k] for k in TOKEN_ENVS if os.environ.get(k)), None)


def resolve_url(endpoint: str, f: RemoteFile) -> str:
    return (f"{endpoint}/{f.repo}/resolve/{urllib.parse.quote(f.revision, safe='')}/"
            f"{urllib.parse.quote(f.path)}")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class _RedirectWithoutToken(urllib.request.HTTPRedirectHandler):
    """urllib's redirects, but a token never follows one to another host (urllib keeps every header)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            for k in [k for k in new.headers if k.lower() == "authorization"]:
                del new.headers[k]
            new.unredirected_hdrs.pop("Authorization", None)
        return new


_PLAIN = urllib.request.build_opener(_RedirectWithoutToken)


def _origin(url: str) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.netloc
_NO_REDIRECT = urllib.request.build_opener(_NoRedirect)


def _request(url: str, token: str | None, endpoint: str, method: str = "GET",
             headers: dict[str, str] | None = None, redirects: bool = True) -> Any:
    """An open response (the caller closes it). The token goes to the endpoint's host only. HTTP errors of the
    endpoint are HubErrors that say what to do; a redirect is returned as is where `redirects` is off."""
    h = dict(headers or {})
    h.setdefault("User-Agent", "decapybara-download")
    if token and _origin(url) == _origin(endpoint):
        h["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, headers=h, method=method)
    try:
        return (_PLAIN if redirects else _NO_REDIRECT).open(req, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        if not redirects and 300 <= e.code < 400:
            return e
        raise _http_error(e, e.url or url, token, endpoint) from None


def _http_error(e: urllib.error.HTTPError, url: str, token: str | None, endpoint: str) -> HttpStatusError:
    """The error a status means, said by who answered it (the Hub, or the CDN it redirected to)."""
    if e.code in (401, 403) and _origin(url) == _origin(endpoint):
        why = ("the token was refused" if token else
               "it needs a token: set HF_TOKEN or pass --token (and accept the model's terms on its page if gated)")
        return HttpStatusError(f"{url}: HTTP {e.code}: {why}", e.code, url)
    if e.code == 403:
        return HttpStatusError(f"{url}: HTTP 403 from the download's server (an expired link?)", 403, url)
    if e.code == 404:
        return HttpStatusError(f"{url}: not found (HTTP 404): check the repository, revision and file names", 404, url)
    return HttpStatusError(f"{url}: HTTP {e.code} {e.reason}", e.code, url)


def list_files(repo: str, revision: str = "main", endpoint: str | None = None,
               token: str | None = None) -> list[RemoteFile]:
    """Every file of `repo` at `revision` (the tree API, all pages), in the Hub's order."""
    ep, tok = endpoint_of(endpoint), token_of(token)
    url: str | None = (f"{ep}/api/models/{repo}/tree/{urllib.parse.quote(revision, safe='')}"
                       f"?recursive=true&expand=false")
    out: list[RemoteFile] = []
    while url:
        with _request(url, tok, ep) as resp:
            entries = json.loads(resp.read())
            url = _next_link(resp.headers.get("Link"), ep)
        for e in entries:
            if e.get("type") != "file":
                continue
            lfs = e.get("lfs") or {}
            out.append(RemoteFile(repo, revision, e["path"], int(e.get("size", lfs.get("size", 0))),
                                  lfs.get("oid") or lfs.get("sha256"), e.get("oid")))
    return out


def _next_link(link: str | None, endpoint: str) -> str | None:
    """The `rel="next"` URL of a `Link` header (made absolute against the endpoint), if any."""
    for part in (link or "").split(","):
        m = re.match(r'\s*<([^>]+)>\s*;.*rel="?next"?', part)
        if m:
            return urllib.parse.urljoin(endpoint + "/", m.group(1))
    return None


def file_info(repo: str, path: str, revision: str = "main", endpoint: str | None = None,
              token: str | None = None) -> RemoteFile:
    """One file's size and checksum from a HEAD of its resolve URL (`X-Linked-Size`, `X-Linked-Etag`), without
    listing the repository; redirects within the endpoint (a renamed repository) are followed, a CDN's is not."""
    ep, tok = endpoint_of(endpoint), token_of(token)
    url = resolve_url(ep, RemoteFile(repo, revision, path, 0, None, None))
    for _ in range(5):
        resp = _request(url, tok, ep, method="HEAD", redirects=False)
        with resp:
            h = resp.headers
            loc = h.get("Location")
            if 300 <= resp.status < 400 and loc and urllib.parse.urlsplit(urllib.parse.urljoin(url, loc)).netloc \
                    == urllib.parse.urlsplit(ep).netloc and not h.get("X-Linked-Size"):
                url = urllib.parse.urljoin(url, loc)  # a renamed repository: ask again there
                continue
            size = h.get("X-Linked-Size")
            etag = (h.get("X-Linked-Etag") or h.get("ETag") or "").strip('"').removeprefix("W/").strip('"')
            if size is None and 300 <= resp.status < 400 and loc:  # the size is the file's, where it is served
                with _request(urllib.parse.urljoin(url, loc), tok, ep, method="HEAD") as final:
                    size = final.headers.get("Content-Length")
            elif size is None:
                size = h.get("Content-Length")
        if size is None:
            raise HubError(f"{url}: the server gave no size")
        sha = etag if re.fullmatch(r"[0-9a-f]{64}", etag) else None
        oid = etag if re.fullmatch(r"[0-9a-f]{40}", etag) else None
        return RemoteFile(repo, revision, path, int(size), sha, oid)
    raise HubError(f"{url}: too many redirects")


# ---- one file ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Part:
    start: int
    end: int  # exclusive
    done: int  # next offset to fetch: [start, done) is on disk


def plan_parts(size: int, connections: int, min_part: int = MIN_PART_BYTES) -> list[_Part]:
    """`size` bytes in up to `connections` parts of nearly equal length, each at least `min_part` (one part for a
    small or empty file)."""
    n = max(1, min(connections, size // max(1, min_part)))
    bounds = [size * i // n for i in range(n + 1)]
    return [_Part(bounds[i], bounds[i + 1], bounds[i]) for i in range(n)]


class _Progress:
    """The `.part.json` record: the parts' progress, saved (atomically) after the data it counts is flushed."""

    def __init__(self, path: Path, f: RemoteFile, parts: list[_Part], commit: str | None) -> None:
        self.path, self.file, self.parts, self.commit = path, f, parts, commit
        self.lock = threading.Lock()

    @staticmethod
    def read(path: Path, f: RemoteFile, commit: str | None) -> list[_Part] | None:
        """The parts of an earlier run of the same file (same size, checksum and commit), or None."""
        try:
            rec = json.loads(path.read_text())
            if (rec.get("size"), rec.get("sha256"), rec.get("git_oid"), rec.get("commit")) != (
                    f.size, f.sha256, f.git_oid, commit):
                return None
            parts = [_Part(int(a), int(b), int(d)) for a, b, d in rec["parts"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        ok = parts and parts[0].start == 0 and parts[-1].end == f.size and all(
            p.start <= p.done <= p.end for p in parts) and all(a.end == b.start for a, b in itertools.pairwise(parts))
        return parts if ok else None

    def save(self, fd: int) -> None:
        """The parts' progress as it stands, made durable: what it counts is flushed before it is written."""
        with self.lock:
            parts = [[p.start, p.end, p.done] for p in self.parts]  # before the flush: no byte counted unflushed
            os.fsync(fd)
            rec = {"repo": self.file.repo, "revision": self.file.revision, "path": self.file.path,
                   "size": self.file.size, "sha256": self.file.sha256, "git_oid": self.file.git_oid,
                   "commit": self.commit, "parts": parts}
            tmp = self.path.with_name(self.path.name + ".tmp")
            with tmp.open("w") as fh:
                fh.write(json.dumps(rec))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)


def _commit_of(url: str, token: str | None, endpoint: str) -> str | None:
    """The commit a resolve URL's revision stands at (`X-Repo-Commit`), so that every part reads one version of
    the file however the branch moves meanwhile; None where the server does not say."""
    resp = _request(url, token, endpoint, method="HEAD", redirects=False)
    with resp:
        commit = resp.headers.get("X-Repo-Commit")
    return commit if commit and re.fullmatch(r"[0-9a-f]{40}", commit) else None


def _accepts_ranges(url: str, token: str | None, endpoint: str) -> bool:
    """Whether the server answers a `Range` request with its part (206)."""
    with _request(url, token, endpoint, headers={"Range": "bytes=0-0"}) as resp:
        if resp.status != 206:
            return False  # the whole file is coming: closed unread
        resp.read()
        return True


def download_file(f: RemoteFile, dest_dir: str | os.PathLike, connections: int = CONNECTIONS,
                  endpoint: str | None = None, token: str | None = None, min_part: int = MIN_PART_BYTES,
                  progress: Callable[[int, int], None] | None = None) -> Path:
    """`f` into `dest_dir/f.name` (module docstring): resumed from an earlier run's `.part` where there is one,
    checked, moved into place; a file already there of the right size and checksum is kept as is. `progress(done,
    total)` is called now and then from the fetching threads. Returns the file's path."""
    ep, tok = endpoint_of(endpoint), token_of(token)
    dest = Path(dest_dir).expanduser() / f.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() and dest.stat().st_size == f.size and _checks(dest, f) is None:
        return dest
    part, record = dest.with_name(dest.name + ".part"), dest.with_name(dest.name + ".part.json")
    commit = _commit_of(resolve_url(ep, f), tok, ep)
    url = resolve_url(ep, f if commit is None else RemoteFile(f.repo, commit, f.path, f.size, f.sha256, f.git_oid))
    ranged = f.size > 0 and _accepts_ranges(url, tok, ep)
    parts = _Progress.read(record, f, commit) if part.exists() and part.stat().st_size == f.size else None
    if parts is None or not ranged:
        parts = plan_parts(f.size, connections if ranged else 1, min_part)  # a server without ranges: from 0
    fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, f.size)
        state = _Progress(record, f, parts, commit)
        state.save(fd)
        _fetch_all(url, tok, ep, fd, state, progress, ranged)
        state.save(fd)
    finally:
        os.close(fd)
    bad = _checks(part, f)
    if bad is not None:
        part.unlink(missing_ok=True)
        record.unlink(missing_ok=True)
        raise HubError(f"{f.repo}/{f.path}: {bad}; the partial download was deleted: run the command again")
    os.replace(part, dest)
    record.unlink(missing_ok=True)
    return dest


def _fetch_all(url: str, token: str | None, endpoint: str, fd: int, state: _Progress,
               progress: Callable[[int, int], None] | None, ranged: bool) -> None:
    """Every part's missing bytes, side by side; the first part that gives up stops the others (their progress
    saved) and its error is raised."""
    stop = threading.Event()
    total = state.file.size
    done = [sum(p.done - p.start for p in state.parts)]
    count_lock = threading.Lock()

    def count(n: int) -> None:
        with count_lock:
            done[0] += n
            if progress is not None:
                progress(done[0], total)

    todo = [p for p in state.parts if p.done < p.end]
    if not todo:
        return
    with cf.ThreadPoolExecutor(len(todo), thread_name_prefix="download") as pool:
        futures = [pool.submit(_fetch_part, url, token, endpoint, fd, p, state, stop, count, ranged)
                   for p in todo]
        try:
            for fut in cf.as_completed(futures):
                fut.result()
        except BaseException:
            stop.set()
            for fut in futures:
                with contextlib.suppress(Exception):
                    fut.result()
            state.save(fd)
            raise


def _fetch_part(url: str, token: str | None, endpoint: str, fd: int, p: _Part, state: _Progress,
                stop: threading.Event, count: Callable[[int], None], ranged: bool) -> None:
    """Part `p`'s bytes from `p.done` on, at their offsets; a failed connection is retried from where it stood,
    `RETRIES` failures in a row at most (then HubError: the run stops, resumable)."""
    failures, since_save = 0, 0
    while p.done < p.end and not stop.is_set():
        headers = {"Range": f"bytes={p.done}-{p.end - 1}"} if ranged else {}
        try:
            with _request(url, token, endpoint, headers=headers) as resp:
                if ranged:
                    got = re.match(r"bytes (\d+)-(\d+)/(\d+|\*)", resp.headers.get("Content-Range") or "")
                    if resp.status != 206 or not got or int(got.group(1)) != p.done:
                        raise HubError(f"{url}: asked for bytes {p.done}-{p.end - 1}, the server sent "
                                       f"{resp.status} {resp.headers.get('Content-Range')}")
                    if got.group(3) != "*" and int(got.group(3)) != state.file.size:
                        raise HubError(f"{url}: the file is {got.group(3)} bytes where the Hub listed "
                                       f"{state.file.size}: it changed; run the command again")
                while p.done < p.end and not stop.is_set():
                    chunk = resp.read(min(CHUNK_BYTES, p.end - p.done))
                    if not chunk:
                        raise ConnectionError(f"the connection closed at byte {p.done} of {p.end}")
                    os.pwrite(fd, chunk, p.done)
                    p.done += len(chunk)
                    since_save += len(chunk)
                    failures = 0
                    count(len(chunk))
                    if since_save >= SAVE_EVERY_BYTES:
                        state.save(fd)
                        since_save = 0
            continue
        except HubError as e:  # a busy or failing server, or a CDN link that expired, is asked again
            if not (isinstance(e, HttpStatusError) and (e.code in RETRY_CODES or
                                                        (e.code == 403 and _origin(e.url) != _origin(endpoint)))):
                raise
            why = str(e)
        except (OSError, ValueError) as e:  # urllib's URLError, a reset, a timeout, an IncompleteRead
            why = f"{url}: {type(e).__name__}: {e}"
        failures += 1
        if failures > RETRIES:
            raise HubError(f"{why} ({RETRIES + 1} tries at byte {p.done}); run the same command again to resume")
        if not ranged:  # a server without ranges: this one connection starts over
            count(p.start - p.done)
            p.done = p.start
        stop.wait(min(8.0, BACKOFF_S * 2 ** (failures - 1)))
    state.save(fd)


def _checks(path: Path, f: RemoteFile) -> str | None:
    """None where the file's bytes are what the Hub lists (SHA-256, or the git blob id), else why not."""
    if f.sha256 is None and f.git_oid is None:
        return None
    sha256, sha1 = hashlib.sha256(), hashlib.sha1(f"blob {f.size}\0".encode())  # git's blob id
    with path.open("rb") as fh:
        while block := fh.read(8 << 20):
            (sha256 if f.sha256 else sha1).update(block)
    if f.sha256 is not None:
        got = sha256.hexdigest()
        return None if got == f.sha256 else f"SHA-256 mismatch: expected {f.sha256}, got {got}"
    got = sha1.hexdigest()
    return None if got == f.git_oid else f"git blob id mismatch: expected {f.git_oid}, got {got}"


# ---- the command ---------------------------------------------------------------------------------------------
def pick_files(files: list[RemoteFile], wanted: list[str]) -> list[RemoteFile]:
    """The files named (by path or file name), or, with none named, the repository's one .mcapy file. HubError
    where a name is not there or the choice is not one file (its message lists the .mcapy files)."""
    weights = [f for f in files if f.path.endswith(SUFFIX)]
    listing = "; ".join(f"{f.path} ({f.size / 2**30:.2f} GiB)" for f in weights) or "none"
    if not wanted:
        if len(weights) == 1:
            return weights
        raise HubError(f"name the files to download: the repository's .mcapy files are {listing}")
    out = []
    for w in wanted:
        hit = [f for f in files if f.path == w] or [f for f in files if f.name == w]
        if len(hit) != 1:
            raise HubError(f"{w}: {'not in' if not hit else 'more than one file of that name in'} the repository; "
                           f"its .mcapy files are {listing}")
        out.append(hit[0])
    return out


def _progress_line(name: str) -> Callable[[int, int], None]:
    """A progress callback that redraws one line on a terminal's stderr at most every 0.5 s."""
    start, last = time.monotonic(), [0.0]

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] < 0.5 and done < total:
            return
        last[0] = now
        rate = done / max(now - start, 1e-6)
        sys.stderr.write(f"\r{name}: {done / 2**30:.2f} / {total / 2**30:.2f} GiB  {rate / 1e6:,.0f} MB/s   ")
        sys.stderr.flush()

    return show


def add_parser(sub: Any) -> None:
    from decapybara.launcher.discover import HOME_MODELS

    d = sub.add_parser("download", help="download .mcapy weights from the Hugging Face Hub (resumable, checked)")
    d.add_argument("repo", help="the repository, e.g. an-org/qwen3.8-27b-mcapy")
    d.add_argument("files", nargs="*", help="files to download (default: the repository's one .mcapy file)")
    d.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    d.add_argument("--dir", default=HOME_MODELS, help=f"where to put them (default {HOME_MODELS}, a model folder)")
    d.add_argument("--connections", type=int, default=CONNECTIONS, help="connections a file (default 8)")
    d.add_argument("--endpoint", default=None, help=f"the Hub (default ${ENDPOINT_ENV} or {DEFAULT_ENDPOINT})")
    d.add_argument("--token", default=None, help="access token for private or gated repositories (default $HF_TOKEN)")
    d.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="draw a progress line (default: when stderr is a terminal)")
    d.set_defaults(func=_cmd_download)


def _cmd_download(args: Any) -> int:
    try:
        return _download(args)
    except KeyboardInterrupt:
        print("\ninterrupted; run the same command again to resume", file=sys.stderr)
        return 130


def _download(args: Any) -> int:
    if args.connections < 1:
        raise HubError("--connections must be at least 1")
    try:
        listed = list_files(args.repo, args.revision, args.endpoint, args.token)
    except HubError:
        if not args.files:
            raise
        listed = None  # a server without the tree API (a plain mirror): each named file from a HEAD of its URL
    files = (pick_files(listed, args.files) if listed is not None else
             [file_info(args.repo, f, args.revision, args.endpoint, args.token) for f in args.files])
    show = sys.stderr.isatty() if args.progress is None else args.progress
    for f in files:
        path = download_file(f, args.dir, args.connections, args.endpoint, args.token,
                             progress=_progress_line(f.name) if show else None)
        if show:
            sys.stderr.write("\n")
        print(f"{path}  {f.size:,} bytes, {'SHA-256' if f.sha256 else 'git blob id'} checked"
              if f.sha256 or f.git_oid else f"{path}  {f.size:,} bytes (no checksum listed)")
    if files and files[0].name.endswith(SUFFIX):
        print(f"Serve it by name: decapybara serve --model {files[0].name[:-len(SUFFIX)]}")
    return 0
