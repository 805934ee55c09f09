"""A local Hugging Face Hub mirror for the tests: a folder served on 127.0.0.1 the way huggingface_hub
reads the Hub, so a fetch by model id runs with no network (`HF_ENDPOINT=mirror.url`).

The folder holds `<owner>/<name>/<files>`; each repo has one commit (40 hex digits: the sha1 of its
file names and contents), reachable as `main` or by its hash. The routes are those huggingface_hub 1.x+
calls (file_download.py, hf_api.py, _snapshot_download.py):

    GET  /api/models/<repo>[/revision/<rev>]          model_info / repo_info: {"id", "sha", "siblings"}
    GET  /api/models/<repo>/tree/<rev>[?recursive=..]  list_repo_tree: [{"type": "file", "path", "size",
                                                       "oid"}]
    HEAD /<repo>/resolve/<rev>/<path>                  file metadata: X-Repo-Commit, ETag (the quoted
                                                       sha256 of the file), Content-Length
    GET  /<repo>/resolve/<rev>/<path>                  the file (the same headers)

An unknown repo answers 404 with `X-Error-Code: RepoNotFound` (huggingface_hub's
RepositoryNotFoundError), an unknown revision `RevisionNotFound`, an unknown file `EntryNotFound`.
Every request is recorded in `requests` (method, path) before it is answered, so a test can assert
what was or was not fetched. `stop()` shuts the server down and joins its thread.

`DroppingServer` is the other end of the test: a Hub that cannot be reached, counting the attempts.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def _commit(repo: Path) -> str:
    h = hashlib.sha1()
    for f in sorted(p for p in repo.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(repo)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


class HubMirror:
    """Serve `root` as a Hub on 127.0.0.1 (an ephemeral port) from a daemon thread."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet: the test output is the record
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                mirror._answer(self, body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                mirror._answer(self, body=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-mirror", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    # ----------------------------------------------------------------------------------- answers
    def _repo(self, owner: str, name: str) -> Path | None:
        repo = self.root / owner / name
        return repo if repo.is_dir() else None

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        with self._lock:
            self.requests.append((h.command, path))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._api(h, parts[2], parts[3], parts[4:], body)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(h, parts[0], parts[1], parts[3], "/".join(parts[4:]), body)
        return self._error(h, 404, "EntryNotFound", body)

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, body: bool) -> None:
        data = json.dumps({"error": code}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _json(self, h: BaseHTTPRequestHandler, obj, body: bool) -> None:
        data = json.dumps(obj).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _revision_ok(self, repo: Path, rev: str) -> bool:
        return rev in ("main", _commit(repo))

    def _api(self, h, owner: str, name: str, rest: list[str], body: bool) -> None:
        repo = self._repo(owner, name)
        if repo is None:
            return self._error(h, 404, "RepoNotFound", body)
        sha = _commit(repo)
        files = sorted(str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file())
        if not rest or rest[0] == "revision":
            if rest and not self._revision_ok(repo, "/".join(rest[1:])):
                return self._error(h, 404, "RevisionNotFound", body)
            return self._json(h, {"id": f"{owner}/{name}", "modelId": f"{owner}/{name}", "sha": sha,
                                  "private": False, "siblings": [{"rfilename": f} for f in files]}, body)
        if rest[0] == "tree" and len(rest) >= 2:
            if not self._revision_ok(repo, rest[1]):
                return self._error(h, 404, "RevisionNotFound", body)
            return self._json(h, [{"type": "file", "path": f, "size": (repo / f).stat().st_size,
                                   "oid": hashlib.sha1((repo / f).read_bytes()).hexdigest()} for f in files],
                              body)
        return self._error(h, 404, "EntryNotFound", body)

    def _file(self, h, owner: str, name: str, rev: str, rel: str, body: bool) -> None:
        repo = self._repo(owner, name)
        if repo is None:
            return self._error(h, 404, "RepoNotFound", body)
        if not self._revision_ok(repo, rev):
            return self._error(h, 404, "RevisionNotFound", body)
        f = repo / rel
        if not f.is_file():
            return self._error(h, 404, "EntryNotFound", body)
        data = f.read_bytes()
        h.send_response(200)
        h.send_header("X-Repo-Commit", _commit(repo))
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        h.send_header("Content-Length", str(len(data)))
        h.send_header("Content-Type", "application/octet-stream")
        h.end_headers()
        if body:
            h.wfile.write(data)


class DroppingServer:
    """A Hub that cannot be reached: every connection on 127.0.0.1 is accepted, counted and reset at once
    (the client sees "Connection reset by peer" or "Server disconnected", network errors that
    huggingface_hub's hf_hub_download retries with backoff: 8 connections for one file, about 25 s).
    `connections` counts them, so a test can tell one attempt from a retry loop without timing it."""

    def __init__(self):
        import socket

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.connections = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="dropping-hub", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import socket
        import struct

        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # the socket was closed: stop
                return
            if self._stopping:
                conn.close()
                return
            self.connections += 1
            # SO_LINGER 0: close with a reset (RST), as a dropped route or a firewall does
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def stop(self) -> None:
        import socket

        self._stopping = True
        with socket.create_connection(self._sock.getsockname()):  # wake accept() so the thread ends
            pass
        self._thread.join()
        self._sock.close()
