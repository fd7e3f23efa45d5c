"""Rowmax-H15 inside an inference engine, end to end: transformers' continuous batching (`model.generate_batch`) on
Qwen2.5-Coder-0.5B, prefill through FA4 varlen with `softmax_mode="rowmax_h15"`, decode through stock FA4
(`fa4_rowmax.hf_paged`), against the same engine with stock FA4 throughout.

    python3 -m bench.engine_e2e --assets-dir DIR --out OUT [--prompts 24] [--min-prompt 100] [--max-prompt 3000]
        [--max-new-tokens 96] [--repeats 3] [--rescale-threshold T] [--max-batch-tokens 8192]
    python3 -m bench.engine_e2e --device cpu --tiny --out OUT     (a random tiny Qwen2 on the reference: a smoke run)

DIR holds `qwen2.5-0.5b/model.gguf` and `austen/austen.txt` as `python -m bench.quality.assets --device-data
qwen2.5-0.5b` lays them out (pinned by size and SHA-256, checked at load). Writes `engine_e2e.json` (settings,
environment, per-mode results) and `engine_e2e.md` (the table) into OUT. A missing asset, or `--device cuda`
without CUDA, is one line on stderr and exit 2.

Note [What the engine run measures]
- Prompts: `--prompts` windows of the Austen text, lengths log-spaced over [--min-prompt, --max-prompt] (nudged off
  multiples of 64), starts spread over the whole text, in a shuffled order so the scheduler mixes long and short.
- Generation: greedy, exactly `--max-new-tokens` per prompt (no end-of-sequence stop, so every mode produces the
  same number of tokens), BF16 weights and cache, no CUDA graphs and no decode fast path (Notes [No CUDA graphs],
  [Paged KV as packed varlen] in fa4_rowmax/hf_paged.py); `--max-batch-tokens` caps a step's tokens, so long
  prompts are prefilled in chunks beside decoding sequences (Note [Prefill and decode steps] there).
- Token agreement with exact: per prompt, the share of positions whose token equals exact's and the first position
  where they differ (None: identical); after a divergence the continuations part ways, so the first divergence is
  the telling number.
- Speed: generated tokens per second of wall time of one whole `generate_batch` (prefill included, one GPU). One
  warm-up call per mode first (FA4 compiles its kernels there; its outputs are the ones compared), then
  `--repeats` timed calls per mode, the modes interleaved (the order flips each repeat); the median is reported.
  Each timed call must reproduce the warm-up's tokens (`deterministic`).
- Perplexity under exact attention: each mode's generated tokens scored by a teacher-forced forward of prompt +
  continuation through transformers' `sdpa` (exact softmax): exp of the mean negative log-likelihood of the
  generated tokens. It asks whether a mode's text is as likely under the exact model as exact's own.
- FP8 rows (`exact_fp8`, `rowmax_h15_fp8`): prefill steps on e4m3 q, smoothed K and V through the SM90 FP8
  forward's varlen path with its tuned defaults (Note [FP8 prefill steps] in fa4_rowmax/hf_paged.py), decode stock
  BF16; token agreement and perplexity are against the BF16 exact row, as for the others. They run where that
  forward does (SM90; on the CPU through the reference) and are recorded as not run elsewhere.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

# row name -> (softmax mode of prefill steps, FP8 prefill); "exact" first: the baseline every row is compared with.
ROWS = {
    "exact": ("exact", False),
    "rowmax_h15": ("rowmax_h15", False),
    "exact_fp8": ("exact", True),
    "rowmax_h15_fp8": ("rowmax_h15", True),
}
MODES = tuple(ROWS)
MODEL = "qwen2.5-0.5b"
JSON_NAME, MARKDOWN_NAME = "engine_e2e.json", "engine_e2e.md"
LENGTH_GRID = 64  # prompt lengths are nudged off its multiples
TINY_LENGTHS = (1, 9, 40, 77, 130)
TINY_VOCAB = 101


class _OneLineParser(argparse.ArgumentParser):
    """A usage error is one line and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def parse_args(argv):
    parser = _OneLineParser(prog="python3 -m bench.engine_e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--assets-dir", type=Path, help="folder with qwen2.5-0.5b/model.gguf and austen/austen.txt")
    parser.add_argument("--out", type=Path, required=True, help="folder for engine_e2e.json and engine_e2e.md")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a random tiny Qwen2 and random prompts (smoke run)")
    parser.add_argument("--prompts", type=_positive_int, default=24)
    parser.add_argument("--min-prompt", type=_positive_int, default=100, help="shortest prompt, tokens")
    parser.add_argument("--max-prompt", type=_positive_int, default=3000, help="longest prompt, tokens")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=None, help="default 96 (--tiny: 4)")
    parser.add_argument(
        "--repeats", type=_positive_int, default=None, help="timed calls per mode; default 3 (--tiny: 1)"
    )
    parser.add_argument("--max-batch-tokens", type=_positive_int, default=None, help="default 8192 (--tiny: 96)")
    parser.add_argument(
        "--rescale-threshold", type=float, default=None, help="rowmax_h15's threshold; default FA4's (SM90: 0)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.min_prompt > args.max_prompt:
        parser.error(f"argument --min-prompt: must be at most --max-prompt ({args.max_prompt}), got {args.min_prompt}")
    if not args.tiny and args.assets_dir is None:
        parser.error("argument --assets-dir: required unless --tiny")
    args.max_new_tokens = args.max_new_tokens or (4 if args.tiny else 96)
    args.repeats = args.repeats or (1 if args.tiny else 3)
    args.max_batch_tokens = args.max_batch_tokens or (96 if args.tiny else 8192)
    return args


def prompt_lengths(count: int, shortest: int, longest: int) -> list[int]:
    """`count` lengths log-spaced over [shortest, longest], each moved off the multiples of LENGTH_GRID."""
    if count == 1:
        raw = [longest]
    else:
        raw = [round(shortest * (longest / shortest) ** (i / (count - 1))) for i in range(count)]
    return [n + 1 if n % LENGTH_GRID == 0 and n + 1 <= longest else n for n in raw]


def text_prompts(token_ids: torch.Tensor, lengths: list[int], seed: int) -> list[list[int]]:
    """Windows of the text with these lengths, starts spread over it, in a seeded shuffled order."""
    span = token_ids.numel() - max(lengths)
    if span < 0:
        raise ValueError(f"the text has {token_ids.numel()} tokens, fewer than the longest prompt ({max(lengths)})")
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    starts = [span * i // max(len(lengths) - 1, 1) for i in range(len(lengths))]
    return [token_ids[starts[i] : starts[i] + lengths[i]].tolist() for i in order]


def tiny_workload(seed: int):
    """A random two-layer Qwen2 (GQA 4/2, head dim 64) and random prompts of TINY_LENGTHS: the CPU smoke run."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=TINY_VOCAB,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
    )
    model = transformers.Qwen2ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist() for n in TINY_LENGTHS]
    return model, prompts, {"model": "random tiny Qwen2 (2 layers, 4/2 heads, head dim 64)", "text": "random tokens"}


def qwen_workload(assets_dir: Path, count: int, shortest: int, longest: int, seed: int):
    """Qwen2.5-Coder-0.5B from the pinned GGUF and Austen prompts (Note [What the engine run measures])."""
    from bench.quality import assets, models, text

    austen = text.load_text(Path(assets_dir) / assets.AUSTEN_DIR, name="austen")  # first: it refuses faster
    tokenizer, model, provenance = models.load_model(models.MODELS[MODEL], assets_dir)
    token_ids = torch.tensor(tokenizer(austen.text, add_special_tokens=False)["input_ids"])
    prompts = text_prompts(token_ids, prompt_lengths(count, shortest, longest), seed)
    provenance.update(
        text="austen", text_sha256=austen.sha256, text_source=austen.source, text_tokens=token_ids.numel()
    )
    return model, prompts, provenance


def to_device(model, device: str, dtype: torch.dtype):
    """The model in `dtype` on `device`, RoPE's inverse frequencies kept in fp32: a BF16 cast of them (model.to casts
    buffers too) shifts the rotary phase of late positions by up to ~2^-9 of the position, radians."""
    rotary = {m: (m.inv_freq.clone(), m.original_inv_freq.clone()) for m in model.modules() if hasattr(m, "inv_freq")}
    model = model.to(device=device, dtype=dtype)
    for module, (inv_freq, original) in rotary.items():
        module.inv_freq, module.original_inv_freq = inv_freq.to(device), original.to(device)
    return model


def batching_config(prompts, max_new_tokens: int, max_batch_tokens: int, block_size: int):
    """Room for every sequence at once (no eviction), no CUDA graphs, no decode fast path, no async double buffer."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    blocks = sum(-(-(len(p) + max_new_tokens) // block_size) for p in prompts) + len(prompts) + 4
    return ContinuousBatchingConfig(
        block_size=block_size,
        num_blocks=blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=len(prompts),
        max_blocks_per_request=0,
        use_cuda_graph=False,
        use_async_batching=False,
    )


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def generate(model, attention, prompts, generation, batching, device: str) -> tuple[list[list[int]], float]:
    """Each prompt's generated tokens (in prompt order) and the wall seconds of the whole `generate_batch`."""
    model.set_attn_implementation(attention.name)
    _synchronize(device)
    start = time.perf_counter()
    # generate_batch runs under no_grad; inference_mode around it breaks its reuse of its input buffers.
    outputs = model.generate_batch(
        prompts, generation_config=generation, continuous_batching_config=batching, warmup=False
    )
    _synchronize(device)
    seconds = time.perf_counter() - start
    failed = [o.error for o in outputs.values() if o.error]
    if failed or len(outputs) != len(prompts):
        raise RuntimeError(f"generate_batch with {attention.name} returned {len(outputs)} of {len(prompts)}: {failed}")
    ordered = sorted(outputs.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[1]))
    for output, prompt in zip(ordered, prompts, strict=True):
        if output.prompt_ids != prompt:
            raise RuntimeError(f"request {output.request_id} does not hold the prompt it was given")
    return [list(o.generated_tokens) for o in ordered], seconds


def agreement(tokens: list[list[int]], exact: list[list[int]]) -> tuple[float, list[int | None]]:
    """The share of positions whose token equals exact's, and each prompt's first differing position (None: none)."""
    same = total = 0
    first = []
    for got, want in zip(tokens, exact, strict=True):
        matches = [a == b for a, b in zip(got, want, strict=True)]
        same, total = same + sum(matches), total + len(matches)
        first.append(next((i for i, m in enumerate(matches) if not m), None))
    return same / total, first


def perplexity_under_exact(model, prompts, continuations) -> float:
    """exp(mean NLL) of the continuations given their prompts, teacher-forced through `sdpa` (exact softmax)."""
    model.set_attn_implementation("sdpa")
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    with torch.inference_mode():
        for prompt, continuation in zip(prompts, continuations, strict=True):
            ids = torch.tensor([prompt + continuation], device=device)
            logits = model(input_ids=ids, logits_to_keep=len(continuation) + 1, use_cache=False).logits[0, :-1]
            target = torch.tensor(continuation, device=device)
            nll += float(torch.nn.functional.cross_entropy(logits.float(), target, reduction="sum"))
            count += len(continuation)
    return math.exp(nll / count)


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"transformers {s['transformers']} continuous batching, {s['model_label']}, {len(s['prompt_lengths'])} prompts "
        f"of {min(s['prompt_lengths'])}-{max(s['prompt_lengths'])} tokens, {s['max_new_tokens']} new tokens each, "
        f"greedy; {s['device_name']}; torch {s['torch']}",
        "",
        f"`{s['command']}`",
        "",
        "| prefill mode | tokens/s (median) | tokens identical to exact | prompts identical | first divergence "
        "(median, diverging prompts) | perplexity under exact |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mode, r in result["modes"].items():
        diverged = [p for p in r["first_divergence"] if p is not None]
        median_divergence = f"{statistics.median(diverged):g}" if diverged else "-"
        lines.append(
            f"| {mode} | {r['tokens_per_second']:.1f} | {r['token_agreement']:.3f} | "
            f"{r['first_divergence'].count(None)}/{len(r['first_divergence'])} | {median_divergence} | "
            f"{r['perplexity_under_exact']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def run(args) -> dict:
    import transformers
    from transformers import GenerationConfig

    from bench import env_info
    from fa4_rowmax import hf_paged

    backend = "kernel" if args.device == "cuda" else "reference"
    if args.tiny:
        model, prompts, provenance = tiny_workload(args.seed)
    else:
        model, prompts, provenance = qwen_workload(
            args.assets_dir, args.prompts, args.min_prompt, args.max_prompt, args.seed
        )
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = to_device(model, args.device, dtype)
    # the FP8 rows run the FP8 forward's defaults (no threshold argument): what flash_attn_varlen_func does unasked
    thresholds = {"exact": None, "rowmax_h15": args.rescale_threshold, "exact_fp8": None, "rowmax_h15_fp8": None}
    fp8_runs = args.device == "cpu" or torch.cuda.get_device_capability()[0] == 9
    rows = [row for row in MODES if fp8_runs or not ROWS[row][1]]
    attentions = {
        row: hf_paged.register(ROWS[row][0], thresholds[row], backend, fp8_prefill=ROWS[row][1]) for row in rows
    }
    generation = GenerationConfig(
        max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    batching = batching_config(prompts, args.max_new_tokens, args.max_batch_tokens, 32 if args.tiny else 256)

    tokens, steps, seconds, deterministic = {}, {}, {mode: [] for mode in rows}, {}
    for mode in rows:  # warm-up: FA4 compiles here; these outputs are the ones compared
        tokens[mode], warm_seconds = generate(model, attentions[mode], prompts, generation, batching, args.device)
        steps[mode] = vars(attentions[mode].steps).copy()
        deterministic[mode] = True
        print(f"warm-up {mode}: {warm_seconds:.1f} s, steps {steps[mode]}", flush=True)
    for repeat in range(args.repeats):
        for mode in rows if repeat % 2 == 0 else rows[::-1]:
            again, wall = generate(model, attentions[mode], prompts, generation, batching, args.device)
            seconds[mode].append(wall)
            deterministic[mode] &= again == tokens[mode]
            print(f"repeat {repeat} {mode}: {wall:.2f} s", flush=True)

    generated = len(prompts) * args.max_new_tokens
    modes = {}
    for mode in rows:
        share, first = agreement(tokens[mode], tokens["exact"])
        modes[mode] = {
            "attention": attentions[mode].name,
            "rescale_threshold": thresholds[mode],
            "generated_tokens": sum(len(t) for t in tokens[mode]),
            "seconds": seconds[mode],
            "tokens_per_second": generated / statistics.median(seconds[mode]),
            "deterministic": deterministic[mode],
            "token_agreement": share,
            "first_divergence": first,
            "perplexity_under_exact": perplexity_under_exact(model, prompts, tokens[mode]),
            "steps_per_call": steps[mode],
            "tokens": tokens[mode],
        }
    settings = {
        "model_label": provenance["model"],
        "provenance": provenance,
        "backend": backend,
        "dtype": str(dtype),
        "prompt_lengths": [len(p) for p in prompts],
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "max_batch_tokens": args.max_batch_tokens,
        "block_size": batching.block_size,
        "seed": args.seed,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "CPU",
        "command": "python3 -m bench.engine_e2e " + " ".join(args.argv),
        "fp8": "run" if fp8_runs else "not run: the SM90 FP8 forward needs an SM90 GPU",
    }
    return {**env_info.collect(settings), "modes": modes}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    args.argv = argv
    from bench.quality.assets import AssetMismatch, MissingAsset

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "engine_e2e: error: --device cuda needs CUDA, and torch sees no GPU (use --device cpu --tiny)",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    try:
        result = run(args)
    except (MissingAsset, AssetMismatch) as refused:  # each names the file and the command that fetches it
        print(f"engine_e2e: error: {refused}", file=sys.stderr)
        return 2
    result["settings"]["wall_seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / JSON_NAME).write_text(json.dumps(result, indent=1) + "\n")
    table = markdown(result)
    (args.out / MARKDOWN_NAME).write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
