"""The app's embedded default: a small random-weight qwen3moe made on first use."""
from __future__ import annotations

from pathlib import Path

import platformdirs
from gguf import GGMLQuantizationType as QT

from engine.synth.routing import routing
from engine.synth.spec import ModelSpec
from engine.synth.writer import Progress, write_model

DEMO_SPEC = ModelSpec(arch="qwen3moe", n_layer=4, n_embd=512, n_head=8, n_head_kv=4, head_dim=64,
                      n_expert=32, n_expert_used=4, n_ff_exp=512, n_ctx=4096, rope_base=1e6,
                      expert_qtype=QT.Q4_K, dense_qtype=QT.Q8_0, name="demo")
DEMO_SEED = 1
DEMO_FILE = "moestudio-demo-qwen3moe-random-weights.gguf"


def demo_model_path(create: bool = True, progress: Progress | None = None) -> Path:
    """Path of the demo model in the user cache directory, written there if missing."""
    path = Path(platformdirs.user_cache_dir("moestudio")) / "models" / DEMO_FILE
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_model(path, DEMO_SPEC, routing("qwen3-30b"), seed=DEMO_SEED, progress=progress)
    return path
