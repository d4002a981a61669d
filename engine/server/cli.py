"""`moestudio serve MODEL.gguf`: the engine as an OpenAI-, Anthropic- and Ollama-compatible HTTP server.

Stack: Starlette on uvicorn. Starlette gives routing, streaming responses that notice client
disconnects, and nothing else: request validation stays ours, so every error comes out in
the shape of the API it belongs to (FastAPI's pydantic layer would answer 422 in its own
shape and have to be overridden endpoint by endpoint). uvicorn is the most used ASGI server,
handles SIGINT/SIGTERM with a graceful shutdown, and accepts a socket we bind ourselves, so a
port in use is one clear error before anything loads. aiohttp would also work, but brings
its own server and client stack where Starlette + uvicorn are two small, well-kept pieces.

The server listens at once and loads the model in the engine thread; GET /health reports
the progress, and the API answers 503 until the model is ready.
"""
from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import signal
import socket
import sys
from pathlib import Path

from engine.config import add_arguments, from_args, save_preset
from engine.errors import UserError

log = logging.getLogger("moestudio.server")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI, Anthropic and Ollama APIs)",
                       description="Serves a GGUF MoE model with OpenAI-, Anthropic- and Ollama-compatible endpoints, "
                       "/health, /v1/stats, /v1/stats/stream and /metrics.")
    p.add_argument("model", nargs="?", help="GGUF model file (or `model` in --config/--preset)")
    add_arguments(p)
    p.add_argument("--save-preset", metavar="NAME", help="also save these settings as a named preset")
    p.set_defaults(run=run)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or a UserError saying why not (port in use, bad address)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # reuse TIME_WAIT, not a live listener
        sock.bind(address)
        sock.listen(128)
    except socket.gaierror as e:
        raise UserError(f"cannot resolve --host {host}: {e.strerror}") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is already in use (another server running?); "
                            "stop it or choose another --port") from None
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.config import resolve_device
    from engine.gguf.check import open_model
    from engine.server.app import build_app
    from engine.server.loader import choose_engine

    cfg = from_args(args)
    if not cfg.model:
        raise UserError("which model? give MODEL.gguf, or `model` in --config/--preset")
    # A file that is not a usable model is refused here, before listening, in one line the app's
    # crash classifier reads as a bad model (the header check takes milliseconds).
    model = open_model(cfg.model, require_moe=cfg.engine != "llamacpp")
    if cfg.moe_expert_profile and cfg.engine != "llamacpp":
        from engine.moe.profile import load_profile

        load_profile(cfg.moe_expert_profile, model)  # one for another model: refused now, not after the load
    # A model no engine can run is refused before listening, saying why.
    choose_engine(cfg.model, cfg.engine, resolve_device(cfg.device))
    if not is_loopback(cfg.host) and not cfg.api_key:
        raise UserError(f"refusing to listen on {cfg.host} without an API key: anyone on the network could use "
                        "it. Set --api-key (or MOESTUDIO_API_KEY), or keep the default --host 127.0.0.1")
    if args.save_preset:
        print(f"moestudio: saved preset {args.save_preset} to {save_preset(args.save_preset, cfg)}", file=sys.stderr)
    # The level word is what the desktop app's Logs tab filters on.
    logging.basicConfig(level=logging.INFO, format="moestudio: %(levelname)s %(message)s", stream=sys.stderr)
    sock = bind(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"moestudio: serving {Path(cfg.model).name} at http://{shown}:{port} "
          f"(loading in the background; GET /health shows progress)", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(build_app(cfg), log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=3))
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again: end with status 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.run(sockets=[sock])
    return 0 if server.started else 1
