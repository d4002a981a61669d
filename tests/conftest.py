"""Shared fixtures: synthetic models made once per test session, and the real-text prompt."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT

try:
    import torch

    if not torch.cuda.is_available():
        # Triton's interpreter is chosen when triton is first imported (its standard library's
        # functions are made then), so before any test module's import: a module that imports
        # triton earlier in collection would otherwise leave the interpreter tests calling
        # compiled helpers such as tl.cdiv.
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover - the setup installs torch
    pass


def _speed_up_the_interpreters_patching() -> None:
    """Triton's interpreter patches triton.language's builtins when a kernel launches and again
    on every call of a @triton.jit function inside it, each time finding them by
    inspect.getmembers over the whole module (~0.4 ms a call; the interpreted kernels call
    helpers thousands of times). Here the builtins are found by name (listed once per module:
    the first patching of a module sees it unpatched; each call still patches only those not
    patched already, as Triton's does), and a helper that reaches the language only through `tl`
    skips the repeat (the launch patched `tl`; Triton's standard library keeps it). The
    interpreted dense tests: 157 -> 110 s. Left alone where the interpreter is not the one this
    was written against (Triton 3.x)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - the setup installs triton
        return
    stock = getattr(interpreter, "_patch_builtin", None)
    if stock is None or not {"getmembers", "is_builtin", "_patch_attr"} <= set(stock.__code__.co_names):
        return
    builtin_names: dict[int, list[str]] = {}

    def patch_builtin(pkg, builder, scope) -> None:
        names = builtin_names.get(id(pkg))
        if names is None:
            names = builtin_names[id(pkg)] = [n for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name in names:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin

    # every kernel here lives in a module that imports triton.language as tl
    call = interpreter.InterpretedFunction.__call__
    if not {"_patch_lang", "rewrite", "InterpreterError"} <= set(call.__code__.co_names):
        return
    only_tl: dict[object, bool] = {}

    def call_in_launch(self, *args, **kwargs):
        if self.fn not in only_tl:
            only_tl[self.fn] = [v for v in self.fn.__globals__.values() if v is tl or v is tl.core] == [tl]
        if not only_tl[self.fn]:
            return call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.InterpretedFunction.__call__ = call_in_launch


_speed_up_the_interpreters_patching()

from engine.synth.routing import routing
from engine.synth.spec import ModelSpec, preset
from engine.synth.writer import write_model


PART_VARIABLE = "MOESTUDIO_TEST_PART"


def part_of(items: list, spec: str) -> tuple[list, list]:
    """The items that part `spec` ("I/N": the I-th of N runs of one selection) keeps, and the rest.
    A part is a contiguous block, so the parametrized cases of one test, which share compiled
    kernels, mostly fall in one part."""
    try:
        index, count = (int(n) for n in spec.split("/"))
    except ValueError:
        index = count = 0
    if not 1 <= index <= count:
        raise pytest.UsageError(f"{PART_VARIABLE}={spec!r}: give I/N with 1 <= I <= N, such as 2/4")
    start, stop = len(items) * (index - 1) // count, len(items) * index // count
    return items[start:stop], items[:start] + items[stop:]


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs: a part splits what they selected
def pytest_collection_modifyitems(config, items):
    spec = os.environ.get(PART_VARIABLE)
    if spec:  # the GPU suite over several device calls, each under the device's limit on one command
        items[:], dropped = part_of(items, spec)
        config.hook.pytest_deselected(items=dropped)
    try:
        has_cuda = torch.cuda.is_available()
    except NameError:  # no torch
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def make_model(model_dir):
    """make_model(spec_or_arch, expert_qtype=None, routing_name='qwen3-30b', seed=0) -> Path, cached."""
    made: dict[tuple, Path] = {}

    def make(spec: ModelSpec | str, expert_qtype: QT | None = None, routing_name: str = "qwen3-30b",
             seed: int = 0) -> Path:
        if isinstance(spec, str):
            spec = preset("tiny", spec)
        if expert_qtype is not None:
            spec = spec.with_(expert_qtype=expert_qtype)
        key = (spec, routing_name, seed)
        if key not in made:
            name = f"{spec.name or spec.arch}-{spec.expert_qtype.name}-{spec.dense_qtype.name}-{routing_name}-{seed}-{len(made)}.gguf"
            made[key] = write_model(model_dir / name, spec, routing(routing_name), seed=seed)
        return made[key]

    return make


@pytest.fixture(scope="session")
def prompt_text() -> str:
    from engine.synth.corpus import stdlib_text

    return stdlib_text(max_chars=400)


@pytest.fixture(autouse=True, scope="session")
def _isolated_user_dirs(tmp_path_factory):
    """Keep tests away from the real user's cache, config and data directories."""
    home = tmp_path_factory.mktemp("home")
    old = {k: os.environ.get(k) for k in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")}
    for k in old:
        os.environ[k] = str(home / k.lower())
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def tiny(make_model) -> Path:
    """The tiny qwen3moe (2 layers, 8 experts, top-2): the default model of most tests."""
    return make_model("qwen3moe")


@pytest.fixture(scope="session")
def identity(tiny):
    """The expert-profile identity (engine/moe/profile.ModelIdentity) of `tiny`."""
    from engine.gguf.reader import ModelFile
    from engine.moe.profile import ModelIdentity

    return ModelIdentity.of(ModelFile.open(tiny))
