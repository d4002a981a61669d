"""`moestudio synth` as a user runs it: a real subprocess, real files."""
from __future__ import annotations

import json
import subprocess
import sys

from gguf import GGUFReader


def moestudio(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_synth_help():
    r = moestudio("synth", "--help")
    assert r.returncode == 0 and "create" in r.stdout and "stats" in r.stdout


def test_create_then_stats(tmp_path):
    out = tmp_path / "m.gguf"
    r = moestudio("synth", "create", "--arch", "olmoe", "--expert-quant", "Q8_0", "--routing", "flat", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert GGUFReader(out).fields["general.architecture"].contents() == "olmoe"
    assert not (tmp_path / "m.gguf.partial").exists()

    r = moestudio("synth", "stats", str(out), "--tokens", "200")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert stats["tokens"] == 200 and stats["n_expert"] == 8 and len(stats["layers"]) == 2
    assert 0 < stats["mean"]["lru_hit_50pct"] <= 1


def test_geometry_preset_shortened(tmp_path):
    out = tmp_path / "g.gguf"
    r = moestudio("synth", "create", "--preset", "qwen3-30b-a3b", "--layers", "1", "-o", str(out))
    assert r.returncode == 0, r.stderr
    gate = next(t for t in GGUFReader(out).tensors if t.name == "blk.0.ffn_gate_exps.weight")
    assert tuple(int(n) for n in gate.shape) == (2048, 768, 128) and gate.tensor_type.name == "Q4_K"
    r = moestudio("synth", "stats", str(out), "--tokens", "64")
    assert r.returncode == 0, r.stderr


def test_chat_family_flag(tmp_path):
    """--chat writes that family's template and special tokens; the server's reader classifies it so."""
    from engine.server.tool_formats import family_of
    from engine.synth.tokenizer import CHAT_FAMILIES

    out = tmp_path / "glm.gguf"
    r = moestudio("synth", "create", "--arch", "qwen3moe", "--chat", "glm", "-o", str(out))
    assert r.returncode == 0, r.stderr
    fields = GGUFReader(out).fields
    template = fields["tokenizer.chat_template"].contents()
    assert template == CHAT_FAMILIES["glm"].template and family_of(template) == "glm"
    assert "<arg_key>" in fields["tokenizer.ggml.tokens"].contents()
    r = moestudio("synth", "create", "--arch", "qwen3moe", "--chat", "nope", "-o", str(tmp_path / "x.gguf"))
    assert r.returncode == 2 and "invalid choice: 'nope'" in r.stderr and "Traceback" not in r.stderr


def test_bad_arguments_are_one_clear_line(tmp_path):
    r = moestudio("synth", "create", "--preset", "tiny", "-o", str(tmp_path / "x.gguf"))
    assert r.returncode == 2 and "tiny needs --arch" in r.stderr and "Traceback" not in r.stderr
    r = moestudio("synth", "stats", str(tmp_path / "missing.gguf"))
    assert r.returncode == 2 and "no such model file" in r.stderr
