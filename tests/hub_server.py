"""A hub endpoint on loopback for tests: the few routes `huggingface_hub.snapshot_download` calls (repo info at a
revision, the file tree, HEAD/GET of a file), over repos held in memory, each request path recorded."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

API = re.compile(r"/api/(models|datasets)/([^/]+/[^/]+)/(revision|tree)/([^/?]+)")
FILE = re.compile(r"/(datasets/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)")


class FakeHub:
    """`repos[(kind, repo_id)] = {"commit": sha, "files": {path: bytes}}` with kind "models" or "datasets"."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], dict] = {}
        self.requests: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, kind: str, repo_id: str, files: dict[str, bytes]) -> str:
        commit = hashlib.sha1(repo_id.encode() + b"".join(sorted(files.values()))).hexdigest()
        self.repos[(kind, repo_id)] = {"commit": commit, "files": files}
        return commit

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                path = self.path.split("?")[0]
                hub.requests.append(f"{self.command} {path}")
                if m := API.fullmatch(path):
                    repo = self._repo(m.group(1), m.group(2), m.group(4))
                    if repo is not None:
                        files = repo["files"]
                        data = ({"id": m.group(2), "sha": repo["commit"],
                                 "siblings": [{"rfilename": f} for f in files]} if m.group(3) == "revision" else
                                [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                 for f, b in files.items()])
                        self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"}, body)
                elif m := FILE.fullmatch(path):
                    repo = self._repo("datasets" if m.group(1) else "models", m.group(2), m.group(3))
                    if repo is not None:
                        content = repo["files"].get(m.group(4))
                        headers = {"X-Repo-Commit": repo["commit"]}
                        if content is None:
                            self._send(404, b"", {**headers, "X-Error-Code": "EntryNotFound"}, body)
                        else:
                            etag = f'"{hashlib.sha1(content).hexdigest()}"'
                            self._send(200, content, {**headers, "ETag": etag}, body)
                else:
                    self._send(404, b"", {}, body)

            def _repo(self, kind: str, repo_id: str, revision: str) -> dict | None:
                repo = hub.repos.get((kind, repo_id))
                if repo is None:
                    self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, True)
                elif revision not in ("main", repo["commit"]):
                    self._send(404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"}, True)
                    repo = None
                return repo

            def _send(self, status: int, data: bytes, headers: dict, body: bool) -> None:
                self.send_response(status)
                for key, value in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(key, value)
                self.end_headers()
                if body and self.command != "HEAD":
                    self.wfile.write(data)

        return Handler
