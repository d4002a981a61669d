"""MoE Studio's engine."""
import os

# Every GPU kernel here was written, tested and timed with Triton fusing a multiply and an add
# into one FMA, as nvcc does for llama.cpp's CUDA kernels. Triton 3.10 stops fusing by default
# (3.9 warns that it will): the same source would then round differently. Set explicitly, so any
# Triton compiles the kernels as they were measured. A value the user sets is kept.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

# cuBLAS serves only the weights the Triton kernels do not read, decoded to float32: the MoE routers
# in every model, and dense weights of the few types the kernels lack (F32, Q4_0, Q3_K, ...). Its
# default workspace (torch 2.11 on Hopper: 32 MiB for each stream that calls it, the eager one and the
# decode graph's capture stream) is GPU memory outside the plan (engine/plan/sizing.py): 64 of the
# 70 MiB an engine under --vram-budget-mib 32 held (H100, session 44). With none, cuBLAS picks
# algorithms that need none; decode's products are a few rows, and how much a prompt's products of
# those types lose is not measured. Torch reads this at its first cuBLAS call, so it is set on import.
# A value the user sets is kept (`bench kernels` records the one its cuBLAS baselines ran with).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":0:0")
