"""I/O faults: a port in use, the model file deleted while it is served, a full disk while a profile is saved.

Each ends in a clear message or keeps working, and nothing already on disk is damaged:
- another server on the port: `moestudio serve` exits 2 in one line the app reads as "port in use",
  and the server that holds the port keeps answering;
- the model file deleted (or another file renamed over it) while served: both engines keep serving
  from their memory map, with the same replies as before (Linux keeps an unlinked file's pages until
  the last map closes). Truncating the file in place is a different fault: docs/RELIABILITY.md says why
  that one ends the server;
- saving a profile when the disk fills (a real EFBIG from a file-size limit, and ENOSPC surfacing only
  at fsync, as on filesystems that allocate late): one-line error, the previous profile byte for byte
  as it was, no partial file left; a stale partial file that is a symlink is replaced, not followed.
"""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from app.worker_state import Cause, classify_crash
from engine.errors import UserError
from engine.moe import profile as profile_module
from engine.moe.profile import ExpertProfile, read_profile, save_profile
from tests.server.conftest import moestudio, start_server

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
MSG = "/v1/messages"


def _replies(server) -> tuple[str, str]:
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 12,
            "temperature": 0}
    status, chat = server.request("POST", CHAT, body)
    assert status == 200, chat
    status, msg = server.request("POST", MSG, body)
    assert status == 200, msg
    return chat["choices"][0]["message"]["content"], msg["content"][0]["text"]


# ---- a port in use ---------------------------------------------------------------------------------

def test_a_port_held_by_another_server(tiny, tmp_path):
    first = start_server(tiny, "--engine", "hybrid", "-c", "256")
    try:
        before = _replies(first)
        r = moestudio("serve", str(tiny), "--port", str(first.port))
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.strip().splitlines() == [
            f"moestudio: error: port {first.port} on 127.0.0.1 is already in use (another server running?); "
            "stop it or choose another --port"]
        # The app reads this exit as a port clash (it then retries on a fresh port), not a bad model.
        assert classify_crash(r.stderr, r.returncode).cause == Cause.PORT_IN_USE
        assert _replies(first) == before and first.request("GET", "/health")[1]["status"] == "ok"
    finally:
        assert first.stop() == 0, "".join(first.log)


# ---- the model file deleted while served -------------------------------------------------------------

@pytest.mark.parametrize("engine", ["hybrid", "llamacpp"])
def test_the_model_file_deleted_or_replaced_while_served(tiny, tmp_path, engine):
    served = tmp_path / "served.gguf"
    shutil.copy(tiny, served)
    s = start_server(served, "-c", "256", "--engine", engine)
    try:
        assert s.health_seen[-1]["status"] == "ok", "".join(s.log)
        before = _replies(s)
        served.unlink()
        assert _replies(s) == before
        # Another file renamed over the name (a re-download): the server keeps the one it mapped.
        other = tmp_path / "other.gguf"
        other.write_bytes(b"GGUF" + bytes(100))
        other.rename(served)
        assert _replies(s) == before
        health = s.request("GET", "/health")[1]
        assert health["status"] == "ok" and health["engine"] == engine
    finally:
        assert s.stop() == 0, "".join(s.log)
    assert "Traceback" not in "".join(s.log)


# ---- a full disk while a profile is saved ------------------------------------------------------------

@pytest.fixture(scope="module")
def profiles(identity) -> tuple[ExpertProfile, ExpertProfile]:
    """Two different profiles of the tiny model: the one already on disk, and the one being saved."""
    rng = np.random.default_rng(3)
    shape = (len(identity.moe_layers), identity.n_expert)
    return (ExpertProfile(identity, rng.random(shape), rng.integers(0, 50, shape)),
            ExpertProfile(identity, rng.random(shape), rng.integers(0, 50, shape)))


FSIZE_CHILD = r"""
import resource, sys
from engine import cli
cli.build_parser()
import engine.moe.profile
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("suffix", [".gguf", ".strp"])
def test_a_file_size_limit_mid_write_keeps_the_previous_profile(profiles, tmp_path, suffix):
    """A real write error from the kernel (EFBIG past RLIMIT_FSIZE; Python ignores SIGXFSZ), through the CLI."""
    old, new = profiles
    source, out = tmp_path / "new.gguf", tmp_path / f"out{suffix}"
    save_profile(new, source)
    save_profile(old, out)
    previous = out.read_bytes()
    limit = len(previous) // 2  # the new file cannot be written whole; the old one is not written at all
    r = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(limit), "profile", "convert", str(source), str(out)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [f"moestudio: error: cannot write {out}: File too large"]
    assert out.read_bytes() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["new.gguf", out.name])


@pytest.mark.parametrize("suffix", [".gguf", ".strp"])
def test_no_space_reported_only_at_fsync_keeps_the_previous_profile(profiles, tmp_path, monkeypatch, suffix):
    """Filesystems that allocate late (and network ones) report a full disk when the data is flushed, not
    when it is written: the profile must be flushed before it replaces the old one. No unprivileged way
    fills a real disk here, so the flush fails by hand."""
    old, new = profiles
    out = tmp_path / f"profile{suffix}"
    save_profile(old, out)
    previous = out.read_bytes()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(profile_module.os, "fsync", full)
    with pytest.raises(UserError) as info:
        save_profile(new, out)
    assert str(info.value) == f"cannot write {out}: No space left on device"
    assert out.read_bytes() == previous and [p.name for p in tmp_path.iterdir()] == [out.name]
    monkeypatch.undo()
    save_profile(new, out)  # with room again, the same call succeeds
    save_profile(new, tmp_path / f"reference{suffix}")
    assert out.read_bytes() == (tmp_path / f"reference{suffix}").read_bytes() != previous


def test_a_stale_partial_file_is_replaced_not_followed(profiles, tmp_path):
    """A killed run can leave PROFILE.partial behind; if it is a link, writing through it would change its
    target."""
    old, new = profiles
    victim = tmp_path / "victim.txt"
    victim.write_text("not a profile")
    out = tmp_path / "profile.gguf"
    (tmp_path / "profile.gguf.partial").symlink_to(victim)
    save_profile(new, out)
    assert victim.read_text() == "not a profile"
    assert read_profile(out).scores.tolist() == new.scores.tolist()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.gguf", "victim.txt"]
