"""The CuTe-DSL softmax stages FA4's patched kernels call into (`softmax_base`, `softmax_sm90`, `softmax_sm100`)
and their CPU compile check (`compile_check`). Importing this package imports nothing else."""
