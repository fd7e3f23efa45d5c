"""Pure PyTorch semantics of every softmax mode (the reference the kernels and the gates are judged against):
`attention` (tiled online softmax, all modes), `exp_approx` (PoT/H15 weights), `mx` (OCP MX formats), `hif8`
(BAPS's HiF8), `fused_softmax` (Fused-Softmax pieces). Imports no kernel library."""
