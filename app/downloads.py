"""Hugging Face downloads: search GGUF repos, list a repo's GGUF files (quants) with sizes and
LFS sha256, download one into the models folder with progress, cancel, resume and a verified
checksum. No Qt: the dialog (app/download_dialog.py) runs these on a worker thread.

huggingface_hub does the hub's side: the search and repo metadata (HfApi, the hub's JSON API),
the file URLs (hf_hub_url), the auth headers (a saved `hf auth login` token, HF_TOKEN) and the
HTTP session (proxies, user agent). The transfer itself is a streamed GET on that session rather
than hf_hub_download, which lands files in its own cache (the library lists the models folder),
cannot be cancelled from another thread, and reports progress only through a tqdm bar. Here a
file streams into `NAME.part` next to its destination; a cancelled or broken download keeps the
.part and resumes with a Range request; the finished file's sha256 must equal the hub's LFS
sha256 before it is renamed into place, and a mismatch deletes the .part.

HF_ENDPOINT (read at each call, so a mirror or a test hub can be set at any time) chooses the hub.
"""
from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

from engine.errors import UserError

from app.library import PARTIAL_SUFFIX, SHARD

DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK = 1 << 20
HEADROOM_BYTES = 1 << 30  # as the planner's: the OS, the app and the engine's own working memory
QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[0-9A-Z]+)*|MXFP4(?:_MOE)?|BF16|F16|F32)(?![A-Za-z0-9])", re.I)


class Cancelled(Exception):
    """The user cancelled; the partial file stays for a resume."""


class ChecksumMismatch(UserError):
    """The downloaded bytes are not the file the hub describes; the partial file was deleted."""


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _api():
    from huggingface_hub import HfApi  # imported on the worker thread: ~0.4 s, not at app start

    return HfApi(endpoint=hub_endpoint())


def _reach_hub() -> None:
    """Raises at once when the hub's host cannot be reached: the search's pages go through
    huggingface_hub's http_backoff, which retries a refused connection for ~24 s first. Through
    huggingface_hub's own session, so its proxy settings hold."""
    from huggingface_hub import get_session

    get_session().head(hub_endpoint(), timeout=10.0)


def _hub_error(what: str, e: Exception) -> UserError:
    """A one-line reason from what huggingface_hub raised (HTTP errors carry the hub's message)."""
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    if isinstance(e, RepositoryNotFoundError):
        return UserError(f"{what}: no such repository on {hub_endpoint()} (or it is private: sign in with "
                         "`hf auth login`)")
    if isinstance(e, HfHubHTTPError):
        return UserError(f"{what}: {str(e).splitlines()[0]}")
    return UserError(f"{what}: cannot reach {hub_endpoint()} ({e}); check the network connection or proxy, "
                     "or set HF_ENDPOINT to a mirror")


@dataclass(frozen=True)
class RepoHit:
    repo_id: str
    downloads: int
    likes: int


@dataclass(frozen=True)
class HubFile:
    filename: str  # the path inside the repo
    size: int
    sha256: str | None  # the LFS object id; None for a file kept in git (small, not a model)


@dataclass(frozen=True)
class HubChoice:
    """One model to download: a single GGUF file, or every shard of a split one."""
    repo_id: str
    name: str
    files: tuple[HubFile, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def quant(self) -> str:
        m = QUANT.search(PurePosixPath(self.name).name)
        return m.group(1).upper() if m else "?"


def search_gguf_repos(query: str, limit: int = 40) -> list[RepoHit]:
    """Model repos tagged gguf that match `query`, most downloaded first."""
    query = query.strip()
    if not query:
        raise UserError("type a few letters of a model's name to search, e.g. qwen3 30b")
    try:
        _reach_hub()
        return [RepoHit(m.id, int(m.downloads or 0), int(m.likes or 0))
                for m in _api().list_models(search=query, filter="gguf", sort="downloads", limit=limit)]
    except Exception as e:
        raise _hub_error("search", e) from None


def repo_choices(repo_id: str) -> list[HubChoice]:
    """The repo's GGUF models with sizes and sha256, a split model's shards as one choice."""
    try:
        info = _api().model_info(repo_id, files_metadata=True)
    except Exception as e:
        raise _hub_error(repo_id, e) from None
    files: dict[str, HubFile] = {}
    for s in info.siblings or []:
        if s.rfilename.lower().endswith(".gguf"):
            files[s.rfilename] = HubFile(s.rfilename, int(s.size or (s.lfs.size if s.lfs else 0) or 0),
                                         s.lfs.sha256 if s.lfs else None)
    choices = []
    for name, f in sorted(files.items()):
        m = SHARD.search(name)
        if not m:
            choices.append(HubChoice(repo_id, name, (f,)))
        elif int(m.group(1)) == 1:
            total, prefix = int(m.group(2)), name[:m.start()]
            parts = tuple(files.get(f"{prefix}-{i:05d}-of-{total:05d}.gguf") for i in range(1, total + 1))
            if all(parts):
                choices.append(HubChoice(repo_id, name, parts))
    return choices


def fit_estimate(size: int, hardware: dict) -> tuple[bool, str]:
    """Whether a file of `size` bytes can run here, from the hardware probe (engine/plan/probe.py)
    alone: the exact plan needs the file's header, which the library prices once it is downloaded."""
    ram = int(hardware["ram_total_bytes"])
    vram = sum(int(g["total_bytes"]) for g in hardware.get("gpus", ()))
    gib = 1 << 30
    if size + HEADROOM_BYTES <= ram:
        return True, "fits in RAM" + (" (the GPU caches the busiest experts)" if vram else "")
    if size + 2 * HEADROOM_BYTES <= ram + vram:
        return True, f"fits in RAM + VRAM ({(ram + vram) / gib:,.0f} GiB)"
    return False, f"too big: {size / gib:,.1f} GiB, this machine has {ram / gib:,.0f} GiB RAM" + (
        f" + {vram / gib:,.0f} GiB VRAM" if vram else "")


def destination(models_dir: Path, repo_id: str, filename: str) -> Path:
    """models_dir/OWNER/REPO/FILENAME, refusing a name that would leave that folder."""
    rel = PurePosixPath(repo_id) / PurePosixPath(filename)
    if rel.is_absolute() or ".." in rel.parts:
        raise UserError(f"refusing the file name {filename!r} of {repo_id}: it points outside the models folder")
    return Path(models_dir).joinpath(*rel.parts)


def partial_bytes(models_dir: Path, choice: HubChoice) -> int:
    """Bytes already on disk for this choice (finished shards and .part files): what a resume skips."""
    done = 0
    for f in choice.files:
        dest = destination(models_dir, choice.repo_id, f.filename)
        part = dest.with_name(dest.name + PARTIAL_SUFFIX)
        done += f.size if dest.is_file() else (part.stat().st_size if part.is_file() else 0)
    return done


class Speed:
    """Bytes per second over the last few seconds (an average since the start would hide a stall)."""

    def __init__(self, window_s: float = 3.0, clock: Callable[[], float] = time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._points: deque[tuple[float, int]] = deque()

    def add(self, total_done: int) -> float:
        now = self.clock()
        self._points.append((now, total_done))
        while len(self._points) > 2 and now - self._points[0][0] > self.window_s:
            self._points.popleft()
        t0, d0 = self._points[0]
        return (total_done - d0) / (now - t0) if now > t0 else 0.0


def eta_text(remaining: int, speed: float) -> str:
    if speed <= 0:
        return "time left unknown"
    s = int(remaining / speed + 0.5)
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60} min left"
    return f"{s // 60} min {s % 60} s left" if s >= 60 else f"{s} s left"


Progress = Callable[[int, int, float], None]  # bytes done, bytes in all, bytes/s now


def download(choice: HubChoice, models_dir: Path, progress: Progress, cancel: threading.Event) -> Path:
    """Downloads every file of the choice (resuming any .part), verifies each, and returns the
    path to open (the first shard). Raises Cancelled, ChecksumMismatch or UserError."""
    from huggingface_hub import get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    session = get_session()
    total = choice.size
    done_before = partial_bytes(models_dir, choice)
    speed = Speed()
    speed.add(done_before)
    finished = 0  # bytes of the files completed in this call's loop
    for f in choice.files:
        dest = destination(models_dir, choice.repo_id, f.filename)
        if dest.is_file() and dest.stat().st_size == f.size:
            finished += f.size
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        url = hf_hub_url(choice.repo_id, f.filename, endpoint=hub_endpoint())
        _download_file(session, url, build_hf_headers(), f, dest,
                       lambda n, base=finished: progress(base + n, total, speed.add(base + n)), cancel)
        finished += f.size
    progress(total, total, 0.0)
    return destination(models_dir, choice.repo_id, choice.files[0].filename)


def _download_file(session, url: str, headers: dict, f: HubFile, dest: Path, progress: Callable[[int], None],
                   cancel: threading.Event) -> None:
    part = dest.with_name(dest.name + PARTIAL_SUFFIX)
    have = part.stat().st_size if part.is_file() else 0
    if have > f.size:  # not this file's beginning (the hub's file changed): start over
        part.unlink()
        have = 0
    digest = hashlib.sha256()
    if have:
        with part.open("rb") as old:  # the resumed file is verified whole, not only the new bytes
            while block := old.read(CHUNK):
                digest.update(block)
    if have < f.size:
        request_headers = {**headers, **({"Range": f"bytes={have}-"} if have else {})}
        try:
            with session.stream("GET", url, headers=request_headers, follow_redirects=True, timeout=30.0) as r:
                if r.status_code == 200 and have:  # the server ignored the Range: the bytes start at 0
                    have, digest = 0, hashlib.sha256()
                elif r.status_code not in (200, 206):
                    raise UserError(f"the hub answered {r.status_code} for {f.filename}"
                                    + (": sign in with `hf auth login` for gated models" if r.status_code in (401, 403)
                                       else ""))
                with part.open("r+b" if have else "wb") as out:
                    out.seek(have)
                    out.truncate()
                    progress(have)
                    for block in r.iter_bytes(CHUNK):
                        if cancel.is_set():
                            raise Cancelled()
                        out.write(block)
                        digest.update(block)
                        have += len(block)
                        progress(have)
        except (Cancelled, UserError):
            raise
        except Exception as e:  # the session's connection and timeout errors: resumable
            raise UserError(f"the download of {f.filename} broke off at {have:,} of {f.size:,} bytes ({e}); "
                            "Resume continues from there") from None
    if have != f.size:
        raise UserError(f"the hub sent {have:,} bytes of {f.filename}, expected {f.size:,}; Resume continues from there")
    if f.sha256 and digest.hexdigest() != f.sha256.lower():
        part.unlink()
        raise ChecksumMismatch(f"{f.filename}: sha256 {digest.hexdigest()} is not the hub's {f.sha256}; the "
                               "downloaded bytes were deleted (download it again)")
    os.replace(part, dest)
