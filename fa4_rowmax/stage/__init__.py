"""The CuTe-DSL softmax stages FA4's patched kernels call into (`softmax_base`, `softmax_sm90`, `softmax_sm100`,
the SM90 FP8 forward). Kernel code only; importing this package imports nothing else."""
