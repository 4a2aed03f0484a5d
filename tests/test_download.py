"""`decapybara download`: weights from a Hub over real HTTP (a local server of the Hugging Face Hub's URL scheme:
the tree API in pages, resolve URLs that redirect to a CDN on another host, ranged reads, a token), with eight
connections, dropped connections, a killed process resumed, a corrupt file refused, and the result found by
`decapybara models`."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from conftest import DEMO, ROOT
from decapybara.launcher import download as dl

REPO, TOKEN, COMMIT = "capy-org/demo-mcapy", "hf_secret", "c" * 40


class FakeHub(http.server.ThreadingHTTPServer):
    """The Hub's API and resolve URLs on 127.0.0.1, its CDN on `localhost` (another host to a client)."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client gone mid-body is the tests' doing
            super().handle_error(request, client_address)

    def __init__(self, files: dict[str, tuple[bytes, bool]]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files = files  # path -> (bytes, kept in LFS)
        self.token: str | None = None
        self.ranges = True
        self.page = 2  # tree entries a page
        self.fail_after: int | None = None  # a CDN response drops its connection after this many bytes ...
        self.failures = 0  # ... this many times
        self.stall_after: int | None = None  # the CDN stops sending once it has sent this many bytes in all
        self.corrupt = False  # the CDN flips a byte of what it sends
        self.cdn_errors: list[int] = []  # statuses the CDN answers its next GETs with (a busy server, an expired link)
        self.lock = threading.Lock()
        self.sent = 0  # CDN body bytes sent
        self.cdn_gets: list[str | None] = []  # each CDN GET's Range header
        self.cdn_auth: list[str] = []  # Authorization headers the CDN saw

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def tree(self) -> list[dict]:
        out = [{"type": "directory", "oid": "0" * 40, "size": 0, "path": "sub"}]
        for path, (data, lfs) in self.files.items():
            e = {"type": "file", "path": path, "size": len(data),
                 "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
            if lfs:
                e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            out.append(e)
        return out


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _authorised(self) -> bool:
        if self.server.token is None or self.headers.get("Authorization") == f"Bearer {self.server.token}":
            return True
        self._send(401, b'{"error": "Invalid credentials"}')
        return False

    def _send(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        hub, url = self.server, urllib.parse.urlsplit(self.path)
        port = hub.server_address[1]
        if url.path.startswith(f"/api/models/{REPO}/tree/"):
            if not self._authorised():
                return
            start = int(urllib.parse.parse_qs(url.query).get("cursor", ["0"])[0])
            entries = hub.tree()
            headers = {"Content-Type": "application/json"}
            if start + hub.page < len(entries):
                headers["Link"] = f'<{url.path}?recursive=true&cursor={start + hub.page}>; rel="next"'
            return self._send(200, json.dumps(entries[start:start + hub.page]).encode(), headers)
        if url.path.startswith(f"/{REPO}/resolve/"):
            if not self._authorised():
                return
            rev, path = url.path.split("/resolve/", 1)[1].split("/", 1)
            path = urllib.parse.unquote(path)
            if rev not in ("main", COMMIT):
                return self._send(404, b"Revision not found")
            if path not in hub.files:
                return self._send(404, b"Entry not found")
            data, lfs = hub.files[path]
            headers = {"Location": f"http://localhost:{port}/cdn/{urllib.parse.quote(path)}", "X-Repo-Commit": COMMIT}
            if lfs:
                headers |= {"X-Linked-Size": str(len(data)), "X-Linked-Etag": f'"{hashlib.sha256(data).hexdigest()}"'}
            return self._send(302, b"", headers)
        if url.path.startswith("/cdn/"):
            return self._cdn(urllib.parse.unquote(url.path[5:]))
        self._send(404, b"no route")

    def _cdn(self, path: str) -> None:
        hub = self.server
        data = hub.files[path][0]
        rng = self.headers.get("Range")
        with hub.lock:
            hub.cdn_gets.append(rng)
            if self.headers.get("Authorization"):
                hub.cdn_auth.append(self.headers["Authorization"])
            error = hub.cdn_errors.pop(0) if hub.cdn_errors and rng != "bytes=0-0" else None
        if error is not None:
            return self._send(error, b"try again")
        start, end = 0, len(data)
        code, headers = 200, {"Accept-Ranges": "bytes"} if hub.ranges else {}
        if rng and hub.ranges:
            a, b = rng.removeprefix("bytes=").split("-")
            start, end = int(a), int(b) + 1
            code, headers = 206, {"Content-Range": f"bytes {start}-{end - 1}/{len(data)}"}
        body = bytearray(data[start:end])
        if hub.corrupt and body:
            body[len(body) // 2] ^= 0xFF
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "HEAD":
            return
        with hub.lock:
            cut = None
            if hub.fail_after is not None and hub.failures > 0 and len(body) > max(1, hub.fail_after):
                hub.failures -= 1
                cut = hub.fail_after
        for i in range(0, len(body) if cut is None else cut, 1 << 16):
            piece = bytes(body[i:min(i + (1 << 16), len(body) if cut is None else cut)])
            stalled = False
            while hub.stall_after is not None and hub.sent >= hub.stall_after:
                stalled = True
                time.sleep(0.05)  # a stalled CDN: the client is killed meanwhile
            if stalled:  # its client is gone: nothing more is sent
                self.close_connection = True
                return
            self.wfile.write(piece)
            with hub.lock:
                hub.sent += len(piece)
        if cut is not None:
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)  # dropped mid-body


@pytest.fixture()
def hub():
    weights = Path(DEMO).read_bytes()
    server = FakeHub({"demo.mcapy": (weights, True), "README.md": (b"# demo weights\n", False),
                      "sub/other.bin": (os.urandom(3000), True)})
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def _files(hub: FakeHub, **kw) -> dict[str, dl.RemoteFile]:
    return {f.path: f for f in dl.list_files(REPO, endpoint=hub.endpoint, **kw)}


def test_eight_connections_bring_the_file_checked_into_a_model_folder(hub, tmp_path, capsys):
    """The tree in pages lists every file with its checksum; a file comes down in eight ranged parts whose bytes
    are the Hub's; the token goes to the Hub, not to the CDN; the CLI with no file named takes the repository's
    one .mcapy file, and `decapybara models` then finds it by name."""
    hub.token = TOKEN
    with pytest.raises(dl.HubError, match="HF_TOKEN"):
        dl.list_files(REPO, endpoint=hub.endpoint)
    files = _files(hub, token=TOKEN)
    assert sorted(files) == ["README.md", "demo.mcapy", "sub/other.bin"]  # over three pages, no directory
    demo = files["demo.mcapy"]
    assert demo.sha256 == hashlib.sha256(Path(DEMO).read_bytes()).hexdigest() and files["README.md"].sha256 is None
    head = dl.file_info(REPO, "demo.mcapy", endpoint=hub.endpoint, token=TOKEN)  # a HEAD of the resolve URL
    assert (head.size, head.sha256) == (demo.size, demo.sha256) and hub.cdn_gets == []
    path = dl.download_file(demo, tmp_path / "models", endpoint=hub.endpoint, token=TOKEN, min_part=1 << 20)
    assert path.read_bytes() == Path(DEMO).read_bytes()
    ranged = [r for r in hub.cdn_gets if r != "bytes=0-0"]
    assert len(ranged) == 8 and len(set(ranged)) == 8 and hub.cdn_auth == []
    assert sorted(p.name for p in path.parent.iterdir()) == ["demo.mcapy"]  # no .part left
    readme = dl.download_file(files["README.md"], tmp_path / "models", endpoint=hub.endpoint, token=TOKEN)
    assert readme.read_bytes() == b"# demo weights\n"  # checked by its git blob id

    hub.cdn_gets.clear()  # the CLI: already there and whole, so nothing is fetched
    env = {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": TOKEN}
    code = _cli(["download", REPO, "--dir", str(tmp_path / "models")], env)
    assert code == 0 and hub.cdn_gets == []
    assert "decapybara serve --model demo" in capsys.readouterr().out
    from decapybara.launcher.discover import discover

    found = {m.name: m for m in discover([str(tmp_path / "models")], include_demo=False)}
    assert found["demo"].path == str(path) and found["demo"].error is None and found["demo"].layers > 0


def _cli(argv: list[str], env: dict[str, str]) -> int:
    from decapybara.cli import main

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return main(argv)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_dropped_connections_resume_at_their_offsets(hub, tmp_path, monkeypatch):
    """A connection that drops mid-part is opened again from the byte it reached, so the bytes sent stay close to
    the file's size; a server that ignores Range gets one connection from the start; a corrupt transfer is refused
    and its partial file deleted."""
    demo = _files(hub)["demo.mcapy"]
    hub.fail_after, hub.failures = 300_000, 6
    path = dl.download_file(demo, tmp_path / "a", endpoint=hub.endpoint, min_part=1 << 20)
    assert path.read_bytes() == Path(DEMO).read_bytes() and hub.failures == 0
    assert hub.sent == demo.size + 1 and len(hub.cdn_gets) == 1 + 8 + 6  # the range probe's byte, 6 reopened

    hub.ranges, hub.sent, hub.cdn_gets[:] = False, 0, []
    path = dl.download_file(demo, tmp_path / "b", endpoint=hub.endpoint, min_part=1 << 20)
    assert path.read_bytes() == Path(DEMO).read_bytes() and hub.cdn_gets == ["bytes=0-0", None]

    hub.ranges, hub.corrupt = True, True
    with pytest.raises(dl.HubError, match="SHA-256 mismatch"):
        dl.download_file(demo, tmp_path / "c", endpoint=hub.endpoint, min_part=1 << 20)
    assert list((tmp_path / "c").iterdir()) == []

    # connections that keep dropping before their first byte: each part gives up after RETRIES + 1 tries in a row
    # (a connection that makes progress is never given up), and what was written stays for a later run
    hub.corrupt, hub.fail_after, hub.failures = False, 0, 10_000
    monkeypatch.setattr(dl, "BACKOFF_S", 0.01)
    with pytest.raises(dl.HubError, match="run the same command again to resume"):
        dl.download_file(demo, tmp_path / "d", endpoint=hub.endpoint, min_part=1 << 20)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["demo.mcapy.part", "demo.mcapy.part.json"]


def test_a_killed_download_resumes_where_its_parts_stood(hub, tmp_path):
    """A process killed mid-download (SIGKILL: nothing saved at exit) leaves its `.part` and progress record; the
    same download run again fetches only what the record does not count as written, and the file checks out."""
    demo = _files(hub)["demo.mcapy"]
    hub.stall_after = demo.size // 2
    code = ("import sys; from decapybara.launcher import download as dl; "
            "dl.SAVE_EVERY_BYTES = 1 << 18; "
            f"f = next(f for f in dl.list_files({REPO!r}, endpoint={hub.endpoint!r}) if f.path == 'demo.mcapy'); "
            f"dl.download_file(f, {str(tmp_path)!r}, endpoint={hub.endpoint!r}, min_part=1 << 20)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline = time.time() + 60
    while hub.sent < hub.stall_after:
        assert time.time() < deadline and proc.poll() is None, "the download did not get going"
        time.sleep(0.05)
    time.sleep(0.5)  # the bytes sent are written and counted
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    first_run = hub.sent
    record = json.loads((tmp_path / "demo.mcapy.part.json").read_text())
    counted = sum(d - a for a, _, d in record["parts"])
    assert 0 < counted <= first_run - 1 < demo.size and len(record["parts"]) == 8  # (the range probe's byte)
    hub.stall_after = None
    path = dl.download_file(demo, tmp_path, endpoint=hub.endpoint, min_part=1 << 20)
    assert path.read_bytes() == Path(DEMO).read_bytes()
    assert hub.sent - first_run == demo.size - counted + 1  # the bytes the record did not count (+ the probe's)


def test_the_cli_names_the_weights_to_choose_and_refuses_bad_names(hub, tmp_path, capsys):
    """Several .mcapy files and none named: the CLI lists them and asks; a name not in the repository is an
    error naming the choices; --connections under 1 is refused."""
    hub.files["demo-small.mcapy"] = hub.files["sub/other.bin"]
    env = {"HF_ENDPOINT": hub.endpoint}
    assert _cli(["download", REPO, "--dir", str(tmp_path)], env) == 2
    err = capsys.readouterr().err
    assert "name the files to download" in err and "demo.mcapy" in err and "demo-small.mcapy" in err
    assert _cli(["download", REPO, "nope.mcapy", "--dir", str(tmp_path)], env) == 2
    assert "nope.mcapy: not in the repository" in capsys.readouterr().err
    assert _cli(["download", REPO, "--connections", "0", "--dir", str(tmp_path)], env) == 2
    assert _cli(["download", REPO, "other.bin", "--dir", str(tmp_path), "--connections", "2"], env) == 0
    assert (tmp_path / "other.bin").read_bytes() == hub.files["sub/other.bin"][0]
    assert list(tmp_path.iterdir()) == [tmp_path / "other.bin"]


def test_one_connection_resumes_and_busy_or_expired_links_are_asked_again(hub, tmp_path, monkeypatch):
    """A one-part download whose connection drops goes on from its offset with a Range request, and a run
    interrupted by a failing server resumes the same way; a busy CDN (503) and an expired link (403) are asked
    again; a file outside LFS gets its size from where it is served; a file that changed on the Hub is refused."""
    monkeypatch.setattr(dl, "BACKOFF_S", 0.01)
    files = _files(hub)
    demo = files["demo.mcapy"]
    hub.fail_after, hub.failures = 3_000_000, 2
    path = dl.download_file(demo, tmp_path / "a", connections=1, endpoint=hub.endpoint)
    assert path.read_bytes() == Path(DEMO).read_bytes() and hub.sent == demo.size + 1
    assert [r for r in hub.cdn_gets if r != "bytes=0-0"] == [
        f"bytes=0-{demo.size - 1}", f"bytes=3000000-{demo.size - 1}", f"bytes=6000000-{demo.size - 1}"]

    hub.fail_after, hub.failures = 5_000_000, 1  # then every connection drops before its first byte: gives up
    monkeypatch.setattr(dl, "RETRIES", 0)
    with pytest.raises(dl.HubError, match="resume"):
        dl.download_file(demo, tmp_path / "b", connections=1, endpoint=hub.endpoint)
    hub.fail_after = None
    path = dl.download_file(demo, tmp_path / "b", connections=1, endpoint=hub.endpoint)  # the next run resumes
    assert path.read_bytes() == Path(DEMO).read_bytes()
    assert [r for r in hub.cdn_gets if r != "bytes=0-0"][-1] == f"bytes=5000000-{demo.size - 1}"

    monkeypatch.setattr(dl, "RETRIES", 5)
    hub.cdn_errors = [503, 403, 429]
    path = dl.download_file(files["sub/other.bin"], tmp_path / "c", endpoint=hub.endpoint)
    assert path.read_bytes() == hub.files["sub/other.bin"][0] and hub.cdn_errors == []

    readme = dl.file_info(REPO, "README.md", endpoint=hub.endpoint)  # no X-Linked-Size: the CDN's length
    assert readme.size == len(b"# demo weights\n") and readme.sha256 is None
    changed = dl.RemoteFile(REPO, "main", "demo.mcapy", demo.size + 7, None, None)
    with pytest.raises(dl.HubError, match="it changed"):
        dl.download_file(changed, tmp_path / "d", endpoint=hub.endpoint, min_part=1 << 20)
