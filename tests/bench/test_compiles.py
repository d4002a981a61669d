"""Kernel compiles counted inside a timed region (engine/bench/compiles.py), through Triton's hooks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.bench.compiles import counting_compiles
from engine.quant import triton_kernels as tk

knobs = pytest.importorskip("triton.knobs")


def _as_triton_calls(hook, name: str):
    """A hook called as Triton's JIT calls it (keyword arguments; `fn` names the kernel)."""
    return hook(key=("sig",), repr=name, fn=SimpleNamespace(name=name), compile={}, is_manual_warmup=False,
                already_compiled=False)


def test_compiles_are_counted_and_hooks_already_set_keep_working() -> None:
    runtime = knobs.runtime
    calls = []

    def earlier_start(**kwargs):
        calls.append(("start", kwargs["fn"].name))
        return True  # Triton then skips the compile: the counter must pass this on

    def earlier_end(**kwargs):
        calls.append(("end", kwargs["fn"].name))

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = earlier_start, earlier_end
    try:
        with counting_compiles() as seen:
            assert _as_triton_calls(runtime.jit_cache_hook, "_gate_up_kernel") is True
            _as_triton_calls(runtime.jit_post_compile_hook, "_gate_up_kernel")
            _as_triton_calls(runtime.jit_cache_hook, "_down_kernel")
            _as_triton_calls(runtime.jit_post_compile_hook, "_down_kernel")
        assert seen.counted and seen.count == 2 and seen.seconds >= 0
        assert seen.as_dict()["kernels"] == ["_down_kernel", "_gate_up_kernel"]
        assert calls == [("start", "_gate_up_kernel"), ("end", "_gate_up_kernel"), ("start", "_down_kernel"),
                         ("end", "_down_kernel")]
        assert (runtime.jit_cache_hook, runtime.jit_post_compile_hook) == (earlier_start, earlier_end)
    finally:
        runtime.jit_cache_hook = runtime.jit_post_compile_hook = None


def test_nothing_counted_leaves_no_hook_behind() -> None:
    with counting_compiles() as seen:
        pass
    assert seen.as_dict() == {"counted": True, "count": 0, "seconds": 0.0, "kernels": []}
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None


@pytest.mark.gpu
def test_gpu_a_new_variant_is_counted_once() -> None:
    """A kernel launched with a specialization this process has not compiled counts once; the
    same launch again is served from the JIT's cache and counts nothing."""
    if tk.INTERPRETED:
        pytest.skip("kernels were imported in interpreter mode")
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, n, STEP: tl.constexpr):
        i = tl.arange(0, STEP)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    x = torch.zeros(64, device="cuda")
    with counting_compiles() as first:
        add_one[(1,)](x, 64, STEP=64)
        torch.cuda.synchronize()
    with counting_compiles() as again:
        add_one[(1,)](x, 64, STEP=64)
        torch.cuda.synchronize()
    assert first.count == 1 and first.kernels[0].endswith("add_one") and first.seconds > 0
    assert again.count == 0 and x.eq(2).all()
