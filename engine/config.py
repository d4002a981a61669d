"""One settings schema for the CLI, the server and the GUI.

A `Config` is built from, in rising priority: the defaults below, a named preset
(platformdirs config dir/presets/NAME.toml), a `--config FILE.toml`, and the command-line
flags. Every field has exactly one TOML key (its name) and one flag (`--name-with-dashes`),
so a file, a preset and the wizard all say the same things. Values from any source pass
through the same parsers, which is where every validation message comes from.

This module imports neither torch nor Qt: the GUI reads and writes presets with it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from platformdirs import user_config_dir

from engine.errors import UserError

ENGINES = ("auto", "hybrid", "llamacpp")
# Must equal engine/moe/policy.POLICIES (tests/server/test_config.py checks); repeated here
# so that reading a config does not import torch.
POLICIES = ("off", "occurrence", "occurrence-sync", "lru", "lfru")
LOAD_MODES = ("auto", "mmap", "none")
DEVICES = ("auto", "cpu", "cuda")  # and cuda:N
API_KEY_ENV = "MOESTUDIO_API_KEY"  # a key in the environment stays out of `ps` listings


@dataclass(frozen=True)
class Config:
    model: str | None = None
    engine: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    ctx: int = 4096
    threads: int | None = None
    device: str = "auto"
    moe_expert_cache_size: str | int = "auto"
    moe_expert_cache_mib: int | None = None
    moe_gpu_miss_fraction: str | float = "auto"
    moe_profile_adapt: str = "occurrence"
    moe_expert_profile: str | None = None
    vram_budget_mib: int | None = None
    load_mode: str = "auto"
    prefill_chunk: int = 512
    n_cpu_moe: str | int = "auto"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                object.__setattr__(self, f.name, _parse(f.name, value))
        # The one check across the two ways to size the cache (each field's parser refuses
        # negatives); the engine's settings pass through here too (runtime/engine.EngineConfig).
        if self.moe_expert_cache_size != "auto" and self.moe_expert_cache_mib is not None:
            raise UserError("give the expert cache as a slot count (moe_expert_cache_size) "
                            "or in MiB (moe_expert_cache_mib), not both")

    @property
    def miss_fraction(self) -> float | None:
        """None for auto: the engine measures uploads against the CPU pool (engine/moe/tune.py)."""
        f = self.moe_gpu_miss_fraction
        return None if f == "auto" else float(f)

    def public(self) -> dict[str, Any]:
        """The settings as JSON-able values, the API key masked (for /health, logs and the GUI)."""
        d = dataclasses.asdict(self)
        d["api_key"] = "***" if self.api_key else None
        return d


# ---- field parsers: each takes a TOML value or a command-line string -----------------------
# Each parser also says what values it takes (`Domain`), which is what the GUI builds its typed
# widgets from (a spin box with these bounds, a combo box with these options), so the bounds and
# option lists exist once, here.

@dataclass(frozen=True)
class Domain:
    """The values a setting takes. kind: "int" (lo..hi), "choice" (options), "word_or_int" (one of
    options, or an int >= lo), "fraction" ("auto" or 0..1), "device" (options or cuda:N), "file",
    "text"."""
    kind: str
    lo: int | None = None
    hi: int | None = None
    options: tuple[str, ...] = ()


def _with_domain(parse: Callable[[Any], Any], domain: Domain) -> Callable[[Any], Any]:
    parse.domain = domain  # type: ignore[attr-defined]
    return parse


def _int(lo: int, hi: int | None = None) -> Callable[[Any], int]:
    def parse(v: Any) -> int:
        if isinstance(v, str) and re.fullmatch(r"[+-]?\d+", v.strip()):
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
            raise ValueError(f"an integer {'>= ' + str(lo) if hi is None else f'in [{lo}, {hi}]'}")
        return v
    return _with_domain(parse, Domain("int", lo, hi))


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        if v not in options:
            raise ValueError(f"one of: {', '.join(options)}")
        return v
    return _with_domain(parse, Domain("choice", options=options))


def _text(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ValueError("a non-empty string")
    return v


def _file(v: Any) -> str:
    return _text(v)


_with_domain(_text, Domain("text"))
_with_domain(_file, Domain("file"))


def _word_or_int(words: tuple[str, ...]) -> Callable[[Any], str | int]:
    count = _int(0)

    def parse(v: Any) -> str | int:
        if v in words:
            return v
        try:
            return count(v)
        except ValueError:
            raise ValueError(f"{' or '.join(repr(w) for w in words)} or an integer >= 0") from None
    return _with_domain(parse, Domain("word_or_int", lo=0, options=words))


def _fraction(v: Any) -> str | float:
    if v == "auto":
        return v
    try:
        f = float(v) if isinstance(v, (str, int, float)) and not isinstance(v, bool) else math.nan
    except ValueError:
        f = math.nan
    if not 0.0 <= f <= 1.0:
        raise ValueError("'auto' or a number in [0, 1]")
    return f


_with_domain(_fraction, Domain("fraction", options=("auto",)))


def resolve_device(device: str) -> str:
    """The torch device a `device` setting names: auto is cuda when torch sees a GPU, else cpu."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _device(v: Any) -> str:
    if not isinstance(v, str) or not (v in DEVICES or re.fullmatch(r"cuda:\d+", v)):
        raise ValueError(f"{', '.join(DEVICES)} or cuda:N")
    return v


_with_domain(_device, Domain("device", options=DEVICES))


@dataclass(frozen=True)
class Field:
    """Everything about one setting but its type and default (the Config dataclass holds those)."""
    parse: Callable[[Any], Any]  # a TOML value or a command-line string -> the value, or ValueError
    label: str  # what the GUI calls it (wizard, settings panel)
    help: str
    metavar: str = "N"
    short: str | None = None  # a short flag beside --name-with-dashes

    @property
    def domain(self) -> Domain:
        return self.parse.domain  # type: ignore[attr-defined]


def _choices(options: tuple[str, ...]) -> str:
    return "{" + ",".join(options) + "}"


FIELDS: dict[str, Field] = {
    "model": Field(_file, "Model", "GGUF model file", "FILE"),
    "engine": Field(_choice(ENGINES), "Engine", "hybrid (this engine), llamacpp, or auto: without a CUDA GPU "
                    "llama.cpp (faster on the CPU alone), with one hybrid when it supports the model's architecture "
                    "and quant types (default: auto)", _choices(ENGINES)),
    "host": Field(_text, "Host", "address to listen on (default: 127.0.0.1; others need --api-key)", "HOST"),
    "port": Field(_int(0, 65535), "Port", "TCP port (default: 8080; 0 picks a free one)"),
    "api_key": Field(_text, "API key", f"require this key (Bearer or x-api-key) on every endpoint but /health; "
                     f"or set {API_KEY_ENV}", "KEY"),
    "ctx": Field(_int(0), "Context (tokens)", "context length in tokens (default: 4096; 0 = the model's training "
                 "length)", short="-c"),
    "threads": Field(_int(1), "CPU threads", "CPU threads (default: the physical cores)", short="-t"),
    "device": Field(_device, "Device", "compute device: auto, cpu, cuda, cuda:N (default: auto)", "DEVICE"),
    "moe_expert_cache_size": Field(_word_or_int(("auto", "all")), "Expert cache (slots per layer)",
                                   "expert slots per layer on the GPU: N, all, or auto (from the memory plan)",
                                   "auto|all|N"),
    "moe_expert_cache_mib": Field(_int(0), "Expert cache (MiB)", "expert cache size in MiB, split over the layers"),
    "moe_gpu_miss_fraction": Field(_fraction, "Miss fraction uploaded", "share of expert misses uploaded to the GPU "
                                   "instead of computed on the CPU in steps of many tokens (a prompt); a decode "
                                   "token's misses run on the CPU: auto (measured at load) or 0..1", "auto|F"),
    "moe_profile_adapt": Field(_choice(POLICIES), "Expert cache policy", "expert cache policy (default: occurrence)",
                               _choices(POLICIES)),
    "moe_expert_profile": Field(_file, "Expert profile file", "expert profile (GGUF or STRP) to fill the cache from",
                                "FILE"),
    "vram_budget_mib": Field(_int(1), "VRAM budget (MiB)", "use at most this much VRAM (MiB), e.g. to emulate a "
                             "smaller GPU"),
    "load_mode": Field(_choice(LOAD_MODES), "Load mode", "mmap: experts read from the memory-mapped file; none: "
                       "copied into pinned RAM at load (2.4x faster decode on the H200: uploads are true DMA); auto "
                       "(default): none on a GPU when the experts take at most half the free RAM, else mmap",
                       _choices(LOAD_MODES)),
    "prefill_chunk": Field(_int(1), "Prefill chunk (tokens)", "prompt tokens per forward pass (default: 512)"),
    "n_cpu_moe": Field(_word_or_int(("auto",)), "llama.cpp: expert layers on CPU", "llamacpp engine on a GPU build: "
                       "keep the experts of the first N layers on the CPU (auto: from the memory plan)", "auto|N"),
}


def _parse(name: str, value: Any) -> Any:
    try:
        return FIELDS[name].parse(value)
    except ValueError as e:
        raise UserError(f"{name} must be {e}, got {value!r}") from None


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ---- TOML files and presets -----------------------------------------------------------------

def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The settings in a TOML file, checked against the schema (unknown keys are refused)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"no such config file: {path}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid TOML: {e}") from None
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise UserError(f"{path}: unknown setting(s) {', '.join(unknown)} (known: {', '.join(FIELDS)})")
    for key, value in data.items():
        try:
            _parse(key, value)
        except UserError as e:
            raise UserError(f"{path}: {e}") from None
    return data


def to_toml(settings: dict[str, Any]) -> str:
    """TOML text for flat scalar settings; None (no TOML null) leaves a key out."""
    lines = []
    for key, value in settings.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = json.dumps(str(value), ensure_ascii=False)  # JSON string escapes are valid TOML
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def write_toml(path: str | os.PathLike[str], cfg: Config) -> Path:
    """Writes the settings that differ from the defaults (a file states choices, not defaults)."""
    path = Path(path)
    default = Config()
    changed = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
               if getattr(cfg, f.name) != getattr(default, f.name)}
    path.parent.mkdir(parents=True, exist_ok=True)
    # A file holding an API key (`serve --save-preset` with MOESTUDIO_API_KEY set writes one) is a
    # secret: this user's only, like the app's own key file. An existing file keeps its mode on open,
    # so it is tightened (while still empty) before the key is written.
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if cfg.api_key else 0o666),
                   "w", encoding="utf-8") as f:
        if cfg.api_key:
            os.chmod(path, 0o600)
        f.write(to_toml(changed))
    return path


def presets_dir() -> Path:
    return Path(user_config_dir("moestudio")) / "presets"


def preset_path(name: str) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
        raise UserError(f"preset name {name!r} must be letters, digits, '.', '_' or '-' (at most 64)")
    return presets_dir() / f"{name}.toml"


def list_presets() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.toml"))


def load_preset(name: str) -> dict[str, Any]:
    path = preset_path(name)
    if not path.is_file():
        known = ", ".join(list_presets()) or "none saved yet"
        raise UserError(f"no preset named {name!r} in {presets_dir()} ({known})")
    return read_toml(path)


def save_preset(name: str, cfg: Config) -> Path:
    return write_toml(preset_path(name), cfg)


# ---- command line ---------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser, names: tuple[str, ...] = tuple(FIELDS)) -> None:
    """One flag per field; unset flags stay out of the namespace so files and presets show through."""
    for name in names:
        if name == "model":
            continue  # a positional argument of each command
        field = FIELDS[name]
        opts = (field.short, flag(name)) if field.short else (flag(name),)
        parser.add_argument(*opts, dest=name, default=argparse.SUPPRESS, metavar=field.metavar, help=field.help)
    parser.add_argument("--config", type=Path, default=None, help="read settings from this TOML file")
    parser.add_argument("--preset", default=None, help=f"read settings from a named preset ({presets_dir()})")


def from_args(args: argparse.Namespace) -> Config:
    """defaults < --preset < --config < flags < the positional model (and the API key env var)."""
    settings: dict[str, Any] = {}
    if getattr(args, "preset", None):
        settings.update(load_preset(args.preset))
    if getattr(args, "config", None):
        settings.update(read_toml(args.config))
    settings.update({name: getattr(args, name) for name in FIELDS if getattr(args, name, None) is not None})
    if "api_key" not in settings and os.environ.get(API_KEY_ENV):
        settings["api_key"] = os.environ[API_KEY_ENV]
    return Config(**{k: (str(v) if k == "model" else v) for k, v in settings.items()})
