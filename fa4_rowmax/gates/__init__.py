"""The correctness gates: `gates` (single-tile and multi-tile log2-ratio bounds on any (q, k, v, causal) ->
(out, lse) backend) and `readback` (the attention probabilities read back through a backend)."""
