"""Weights kept in their GGUF form, multiplied the way ggml's CPU backend multiplies them.

The engine's numerical contract: before a weight of type W is applied, the activation is
rounded to W's vec_dot_type (engine/quant/activation.py), exactly as ggml's CPU matmul and
the CPU expert pool do. The product itself is float32. So dense layers, GPU experts and CPU
experts all agree with llama.cpp up to float32 summation order.

On CUDA a quantized weight stays in its GGUF bytes (a VRAM budget is not spent on float32
copies, 3.8x the size of Q8_0), in the layout the kernels read fastest
(engine/quant/layout.kernel_layout: Q6_K blocks padded to 224 bytes, 6.7% more bytes; MXFP4
and Q8_0 rows planar, 0.4% more at K >= 2,880; the other types as the file has them); one copy
serves both paths, both reading the blocks
directly: a few rows (decode) through the split-K dense kernel (quant/triton_kernels.dense),
more rows (prompts) through the grouped GEMM's int8 tensor-core product (quant/grouped_gemm.dense).
"""
from __future__ import annotations

from functools import partial

import torch
from gguf import GGMLQuantizationType as QT

from engine.gguf.reader import ModelFile
from engine.kernels import triton_applies
from engine.layers.precision import matmul
from engine.quant.activation import round_activation
from engine.quant.dequant import check_supported, dequantize
from engine.quant.layout import dequantize_layout, kernel_layout


class Linear:
    """y = round(x) @ W.T + b for a 2-D GGUF weight [out, in] (numpy order)."""

    def __init__(self, raw: torch.Tensor, qtype: QT, shape: tuple[int, int], bias: torch.Tensor | None,
                 device: torch.device | str):
        self.qtype = qtype
        self.shape = shape
        self.bias = bias
        self.raw: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        if _kernel_applies(qtype, device):
            # Laid out on the host, then uploaded: the GPU never holds a second layout.
            self.raw = kernel_layout(raw.reshape(shape[0], -1), qtype).to(device).unsqueeze(0)
        else:
            self.weight = dequantize(raw.to(device), qtype, shape)

    @classmethod
    def load(cls, mf: ModelFile, name: str, device: torch.device | str, bias: str | None = None) -> "Linear":
        info = mf.tensors[f"{name}.weight"]
        check_supported(info.qtype, info.name)
        b = None
        bias_name = f"{name}.bias" if bias is None else bias
        if bias_name in mf.tensors:
            b = load_vector(mf, bias_name, device)
        return cls(mf.torch_raw(info.name), info.qtype, info.shape, b, device)

    @classmethod
    def concat(cls, parts: list["Linear"]) -> "Linear | None":
        """One Linear whose output rows are the parts' rows in order, when every part stays
        quantized in one type on the kernels' path (else None): one launch of the dense kernel
        instead of one per part for the same activation (q, k and v), and the activation rounded
        once. The parts' GPU copies are moved into it; each output row is computed as before."""
        first = parts[0]
        if any(p.raw is None or p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
            return None
        fused = cls.__new__(cls)
        fused.qtype, fused.weight = first.qtype, None
        fused.shape = (sum(p.shape[0] for p in parts), first.shape[1])
        fused.raw = torch.cat([p.raw for p in parts], dim=1)
        biases = [p.bias if p.bias is not None else torch.zeros(p.shape[0], device=p.raw.device) for p in parts]
        fused.bias = torch.cat(biases) if any(p.bias is not None for p in parts) else None
        for p in parts:
            p.raw = p.bias = None
        return fused

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.raw is None:
            y = matmul(round_activation(x, self.qtype), self.weight.T)
        elif x.dtype != torch.float32:  # a float64 reference run (layers/precision)
            y = matmul(round_activation(x, self.qtype), dequantize_layout(self.raw[0], self.qtype, self.shape).T)
        else:
            from engine.quant import grouped_gemm as gg, triton_kernels as tk  # loaded: _kernel_applies imported tk

            x = x if x.stride(-1) == 1 else x.contiguous()
            if x.shape[0] <= tk.DENSE_MAX_ROWS:
                y = tk.dense(x, self.raw, self.qtype, self.shape[0])
            else:
                y = gg.dense(x, self.raw, self.qtype)
        return y + self.bias if self.bias is not None else y


def compile_dense_kernels(weights: list[tuple[Linear, int]]) -> None:
    """Compiles, without launching them, the few-row dense kernel's variants that these weights
    run with 1 to `rows` rows each (one per weight layout and row count; quant/triton_kernels
    .compile_in_parallel: in parallel threads), so that Engine.warm_up's forward passes find them
    compiled. Weights off the kernels' path have nothing to compile."""
    from engine.quant import triton_kernels as tk

    variants = {}
    for lin, rows in weights:
        if lin.raw is None:
            continue
        for n in range(1, min(rows, tk.DENSE_MAX_ROWS) + 1):
            key = (lin.qtype, lin.shape, lin.raw.stride(), n)
            variants.setdefault(key, partial(tk.compile_dense, lin.raw, lin.qtype, *lin.shape, n))
    tk.compile_in_parallel(list(variants.values()))


def _kernel_applies(qtype: QT, device: torch.device | str) -> bool:
    """Quantized weights stay quantized where the Triton kernels run (engine.kernels.triton_applies)
    and can read them; elsewhere they are decoded once to float32."""
    if qtype == QT.F32 or not triton_applies(device):
        return False
    from engine.quant import triton_kernels as tk

    return tk.dense_supported(qtype)


def load_vector(mf: ModelFile, name: str, device: torch.device | str) -> torch.Tensor:
    """A 1-D (or small) tensor such as a norm weight or bias, as float32 on `device`."""
    info = mf.tensors[name]
    check_supported(info.qtype, info.name)
    return dequantize(mf.torch_raw(name).to(device), info.qtype, info.shape)


def optional_vector(mf: ModelFile, name: str, device: torch.device | str) -> torch.Tensor | None:
    return load_vector(mf, name, device) if name in mf.tensors else None
