"""MoE Studio's engine."""
import os

# Every GPU kernel here was written, tested and timed with Triton fusing a multiply and an add
# into one FMA, as nvcc does for llama.cpp's CUDA kernels. Triton 3.10 stops fusing by default
# (3.9 warns that it will): the same source would then round differently. Set explicitly, so any
# Triton compiles the kernels as they were measured. A value the user sets is kept.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
