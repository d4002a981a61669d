"""A local stand-in for the Hugging Face hub, on 127.0.0.1, answering the few endpoints that
huggingface_hub and app/downloads.py use, in the hub's shapes: model search
(/api/models?search=&filter=gguf), a repo's files with sizes and LFS sha256
(/api/models/OWNER/NAME?blobs=true), and file downloads (/OWNER/NAME/resolve/REV/FILE) with
Range support. Tests point HF_ENDPOINT at it; no machine here reaches the real hub."""
from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit


@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]]  # repo id -> file name -> content
    downloads: dict[str, int] = field(default_factory=dict)
    wrong_sha256: set[str] = field(default_factory=set)  # "repo/file" whose advertised sha256 is not the content's
    chunk: int = 64 << 10
    delay_s: float = 0.0  # after each chunk: a slow link, so a test can cancel mid-file
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Range header

    def start(self) -> str:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_HEAD(self):
                self._serve(head=True)

            def do_GET(self):
                self._serve(head=False)

            def _json(self, obj, code: int = 200, error_code: str | None = None) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                if error_code:  # as the hub says it; huggingface_hub picks its exception class by it
                    self.send_header("X-Error-Code", error_code)
                    self.send_header("X-Error-Message", obj["error"])
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _serve(self, head: bool) -> None:
                url = urlsplit(self.path)
                path, query = unquote(url.path), parse_qs(url.query)
                hub.requests.append((self.command, path, self.headers.get("Range")))
                if path == "/api/models":
                    words = query.get("search", [""])[0].lower().split()
                    hits = [{"id": r, "modelId": r, "downloads": hub.downloads.get(r, 0), "likes": 0,
                             "tags": ["gguf"], "private": False}
                            for r in hub.repos if all(w in r.lower() for w in words)]
                    hits.sort(key=lambda h: -h["downloads"])
                    return self._json(hits[:int(query.get("limit", ["1000"])[0])])
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
                if m:
                    repo = hub.repos.get(m.group(1))
                    if repo is None:
                        return self._json({"error": "Repository not found"}, 404, "RepoNotFound")
                    siblings = []
                    for name, content in repo.items():
                        sha = hashlib.sha256(content).hexdigest()
                        if f"{m.group(1)}/{name}" in hub.wrong_sha256:
                            sha = hashlib.sha256(content + b"!").hexdigest()
                        siblings.append({"rfilename": name, "size": len(content), "blobId": sha[:40],
                                         "lfs": {"size": len(content), "sha256": sha, "pointerSize": 134}})
                    return self._json({"id": m.group(1), "modelId": m.group(1), "sha": "0" * 40, "private": False,
                                       "tags": ["gguf"], "siblings": siblings})
                m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
                content = hub.repos.get(m.group(1), {}).get(m.group(2)) if m else None
                if content is None:
                    return self._json({"error": "Entry not found"}, 404, "EntryNotFound")
                start, code = 0, 200
                rng = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if rng:
                    start, code = int(rng.group(1)), 206
                    if start >= len(content):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(content)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                self.send_response(code)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(content) - start))
                if code == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}")
                self.end_headers()
                if head:
                    return
                try:
                    for i in range(start, len(content), hub.chunk):
                        self.wfile.write(content[i:i + hub.chunk])
                        if hub.delay_s:
                            time.sleep(hub.delay_s)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client cancelled

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
