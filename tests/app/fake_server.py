"""A stand-in for `moestudio serve` in engine-manager tests that need a misbehaving worker
(crash loops, load errors, stuck loads, a taken port) without paying for torch.
Usage: fake_server.py --port P --mode ok|error|slow|stuck|oom|segv"""
from __future__ import annotations

import argparse
import errno
import http.server
import json
import os
import socket
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--port", type=int, required=True)
p.add_argument("--mode", default="ok")
args = p.parse_args()

if args.mode == "oom":
    print("moestudio: loading", file=sys.stderr)
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB", file=sys.stderr)
    sys.exit(1)
if args.mode == "segv":
    print("moestudio: loading", file=sys.stderr, flush=True)
    os.kill(os.getpid(), 11)

sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT does not block a restart
try:
    sock.bind(("127.0.0.1", args.port))
except OSError as e:
    if e.errno == errno.EADDRINUSE:
        print(f"moestudio: error: port {args.port} on 127.0.0.1 is already in use (another server running?); "
              "stop it or choose another --port", file=sys.stderr)
        sys.exit(2)
    raise
sock.close()
started = time.time()


class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        age = time.time() - started
        if args.mode == "error":
            body, code = {"status": "error", "progress": 10, "stage": "failed",
                          "error": "cannot read the model: not a GGUF file (bad magic)"}, 503
        elif args.mode == "stuck":
            body, code = {"status": "loading", "progress": 42, "stage": "reading model"}, 200
        elif args.mode == "slow" or age < 0.6:
            body, code = {"status": "loading", "progress": min(99, int(age * 10)), "stage": "reading model"}, 200
        else:
            body, code = {"status": "ok", "progress": 100, "stage": "ready", "engine": "fake"}, 200
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


print(f"moestudio: serving fake at http://127.0.0.1:{args.port}", file=sys.stderr, flush=True)
http.server.ThreadingHTTPServer(("127.0.0.1", args.port), H).serve_forever()
