"""Does Hopper's FP8 accumulator explain the FP8 kernel-vs-simulator gap? A CPU emulation on the study's blocks.

The H200 study (bench/results/h200_2026-12-01_s4/qwen15c/, 48 blocks of 2,048 Austen tokens, Qwen2.5-Coder-1.5B)
found the SM90 FP8 kernel worse than its simulator by +0.0195 nats (exact_fp8) and, with K smoothing
(qwen15ks/), better by -0.0023. The simulator sums Q K^T and P V in fp32; the kernel in Hopper's FP8 wgmma
accumulator. This script scores the first blocks of that study's order through the simulator with the emulated
accumulator (`SoftmaxConfig.accumulator_mantissa_bits`, Note [Emulated FP8 MMA accumulator] in
fa4_rowmax/reference/mma_accumulator.py) at several widths, in a chosen set of layers, and sets the per-block
delta-NLL beside the H200 kernel's and simulator's per-block values read from the study's JSON.

Per block:
- the fp32 `sdpa` baseline (as bench.quality), recording layer 0's q and k;
- a layer-0 diagnostic: the score error of the emulated Q K^T against the exact sum of the same e4m3 products,
  on the block's last `--diag-rows` query rows (every key they see), plain and K-smoothed: in log2 units, its
  spread under the exact softmax (sqrt Var_p(dt), what the softmax sees), its p-weighted mean (a row constant,
  cancelled by the softmax) and max |dt|;
- end to end: the block's delta-NLL, KL and top-1 agreement against the baseline for each mode x width, the
  reference fed bf16 q/k/v as the study's `sim_bf16in_` runs are.

    .venv/bin/python -m studies.fp8_accumulator.study --blocks 2 --bits none 13 --layers 0 \
        --out bench/results/fp8_accumulator_study_qwen15b.json
"""

import argparse
import dataclasses
import json
import math
import platform
import time
from pathlib import Path

import torch

from fa4_rowmax import hf
from fa4_rowmax.reference.mma_accumulator import emulated_matmul

LOG2E = 1.0 / math.log(2.0)
KERNELS_JSON = Path("bench/results/h200_2026-12-01_s4/qwen15c/quality_qwen25-15b_austen_kernels.json")
KSMOOTH_JSON = Path("bench/results/h200_2026-12-01_s4/qwen15ks/quality_qwen25-15b_austen_fp8_ksmooth.json")


def parse_layers(spec: str, num_layers: int) -> set[int]:
    """'all' -> every layer; '0' -> {0}; '1-27' -> {1, ..., 27}; '0,2-4' -> {0, 2, 3, 4}."""
    if spec == "all":
        return set(range(num_layers))
    out = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def emulated_mode(base: str, bits: int | None, layers: set[int], gemms: str) -> hf.ModeSpec:
    """`base`'s ModeSpec with the emulated accumulator in `layers` (fp32 GEMMs elsewhere)."""
    spec = hf.MODES[base]
    if bits is None:
        return spec

    def layer_fields(layer_idx, num_layers):
        inside = layer_idx in layers
        return {"accumulator_mantissa_bits": bits if inside else None, "accumulator_gemms": gemms}

    name = f"{base}_acc{bits}_{gemms}"
    return dataclasses.replace(spec, name=name, layer_fields=layer_fields, kernel=None, kernel_factory=None)


class Recorder:
    """sdpa that records layer 0's query and key (after RoPE)."""

    def __init__(self):
        self.q = self.k = self.scale = None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if module.layer_idx == 0:
            self.q, self.k, self.scale = query[0].clone(), key[0].clone(), scaling
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )


def layer0_diagnostic(q: torch.Tensor, k: torch.Tensor, scale: float, bits_list, rows: int) -> dict:
    """Score errors of the emulated Q K^T on layer 0's e4m3 q, k: plain and K-smoothed (module docstring)."""
    heads_q, length, _ = q.shape
    group = heads_q // k.shape[0]
    out = {}
    for smoothing in (False, True):
        kk = k.to(torch.bfloat16)
        kk = hf.smooth_k(kk.transpose(0, 1)[None])[0].transpose(0, 1) if smoothing else kk
        q8 = hf.to_e4m3(q.to(torch.bfloat16))[0].float()[:, length - rows :]
        k8 = hf.to_e4m3(kk)[0].float()
        k8g = k8.repeat_interleave(group, dim=0)
        exact = q8.double() @ k8g.double().transpose(-1, -2)  # e4m3 products summed in fp64: exact here
        pos = torch.arange(length - rows, length)[:, None]
        visible = torch.arange(length)[None, :] <= pos
        t = exact * scale * LOG2E
        p = torch.softmax(t.masked_fill(~visible, -math.inf), dim=-1)
        entry = {"row_max_abs_t_median": float(t.masked_fill(~visible, 0).abs().amax(-1).median())}
        for bits in bits_list:
            got = emulated_matmul(q8, k8g, bits, -6, -6).double()
            dt = ((got - exact) * scale * LOG2E).masked_fill(~visible, 0.0)
            mean = (p * dt).sum(-1, keepdim=True)
            spread = ((p * (dt - mean) ** 2).sum(-1)).sqrt()
            entry[str(bits)] = {
                "dt_spread_rms": float(spread.pow(2).mean().sqrt()),
                "dt_p_mean": float(mean.mean()),
                "dt_max_abs": float(dt.abs().max()),
            }
        out["ksmooth" if smoothing else "plain"] = entry
    return out


def h200_values(block_indices: list[int]) -> dict:
    """Per-block kernel and simulator delta-NLL from the study's JSONs, for `block_indices`."""
    out = {}
    for path, modes in ((KERNELS_JSON, ("exact_fp8", "rowmax_h15_fp8")), (KSMOOTH_JSON, ("exact_fp8_ksmooth",))):
        data = json.loads(path.read_text())
        order = data["meta"]["block_indices"]
        for mode in modes:
            for side, prefix in (("kernel", "kernel_"), ("sim", "sim_bf16in_")):
                values = data["runs"][prefix + mode]["per_block_delta_nll"]
                out.setdefault(mode, {})[side] = [values[order.index(b)] if b in order else None for b in block_indices]
    return out


def markdown(report: dict) -> str:
    lines = [
        "# FP8 accumulator emulation (CPU) beside the H200 kernel and simulator",
        "",
        f"Blocks {report['block_indices']} (2,048 tokens each); emulated layers {report['layers']}; GEMMs "
        f"{report['gemms']}; {report['device']}, torch {report['torch']}, {report['threads']} threads.",
        "",
        "| block | mode | accumulator | CPU simulator delta-NLL | H200 simulator | H200 kernel | kernel - CPU |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    h200 = report["h200"]
    for b, block in enumerate(report["blocks"]):
        for run in block["runs"]:
            ref = h200.get(run["mode"], {})
            kern = ref.get("kernel", [None] * (b + 1))[b]
            sim = ref.get("sim", [None] * (b + 1))[b]
            fmt = lambda x: "-" if x is None else f"{x:+.5f}"  # noqa: E731
            diff = None if kern is None else kern - run["delta_nll"]
            lines.append(
                f"| {block['index']} | {run['mode']} | {run['accumulator']} | {fmt(run['delta_nll'])} | {fmt(sim)} | "
                f"{fmt(kern)} | {fmt(diff)} |"
            )
    lines += ["", "Layer 0 score error of the emulated Q K^T (log2 units; last rows of each block):", ""]
    lines += [
        "| block | k | bits | dt spread (RMS) | p-mean dt | max abs dt |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for block in report["blocks"]:
        for kind, entry in block.get("layer0", {}).items():
            for bits, e in entry.items():
                if isinstance(e, dict):
                    lines.append(
                        f"| {block['index']} | {kind} | {bits} | {e['dt_spread_rms']:.4f} | {e['dt_p_mean']:+.4f} | "
                        f"{e['dt_max_abs']:.4f} |"
                    )
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--assets-dir", type=Path, default=Path(".cache/quality_models"))
    ap.add_argument("--blocks", type=int, default=2, help="the first N blocks of the H200 study's order")
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--modes", nargs="*", default=["exact_fp8", "exact_fp8_ksmooth"])
    ap.add_argument("--bits", nargs="*", default=["none", "13"], help='"none" = fp32 GEMMs (the simulator)')
    ap.add_argument("--layers", default="0", help='layers that get the emulated accumulator: "all", "0", "0-1"')
    ap.add_argument("--gemms", default="qk_pv", choices=("qk_pv", "qk", "pv"))
    ap.add_argument("--diag-bits", nargs="*", type=int, default=[13, 14, 16, 23])
    ap.add_argument("--diag-rows", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help='"cuda": the model, the baseline and the reference on the GPU')
    ap.add_argument("--out", type=Path, required=True, help="JSON path; a .md goes beside it")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from bench.quality.stats import mean_kl, score_block
    from bench.quality.workload import load_from_gguf

    block_indices = json.loads(KERNELS_JSON.read_text())["meta"]["block_indices"][: args.blocks]
    workload = load_from_gguf(None, False, model=args.model, text_name="austen", assets_dir=args.assets_dir)
    model = workload.model
    if args.device == "cuda":  # as bench.quality: the fp32 baseline and the simulator must not drop to TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model.to(args.device)
    num_layers = model.config.num_hidden_layers
    layers = parse_layers(args.layers, num_layers)
    print(f"loaded {args.model} in {time.perf_counter() - started:.0f} s; blocks {block_indices}", flush=True)

    bits_list = [None if b == "none" else int(b) for b in args.bits]
    specs = {}
    for mode in args.modes:
        for bits in bits_list:
            spec = emulated_mode(mode, bits, layers, args.gemms)
            specs[spec.name] = (mode, bits, spec)
    table = {name: spec for name, (_, _, spec) in specs.items()}
    hf.register(list(table), backend="reference", table=table)
    state = hf.attach(model, reference_input_dtype=torch.bfloat16)
    recorder = Recorder()
    AttentionInterface.register("fp8_acc_recorder", recorder)
    AttentionMaskInterface.register("fp8_acc_recorder", sdpa_mask)

    report = {
        "model": workload.provenance.get("model"),
        "block_indices": block_indices,
        "layers": args.layers,
        "gemms": args.gemms,
        "device": torch.cuda.get_device_name()
        if args.device == "cuda"
        else (platform.processor() or platform.machine()),
        "torch": torch.__version__,
        "threads": args.threads,
        "h200": h200_values(block_indices),
        "blocks": [],
    }

    def write():
        report["wall_seconds"] = time.perf_counter() - started
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(report))

    for index in block_indices:
        ids = workload.token_ids[index * args.block_size : (index + 1) * args.block_size]
        t0 = time.perf_counter()
        base = score_block(model, ids, "fp8_acc_recorder")
        block = {"index": index, "baseline_nll": float(base.nll.mean()), "baseline_seconds": time.perf_counter() - t0}
        report["blocks"].append(block)
        print(
            f"block {index}: baseline NLL {block['baseline_nll']:.4f} ({block['baseline_seconds']:.0f} s)", flush=True
        )
        t0 = time.perf_counter()
        if args.diag_bits:
            block["layer0"] = layer0_diagnostic(
                recorder.q.float().cpu(), recorder.k.float().cpu(), recorder.scale, args.diag_bits, args.diag_rows
            )
            block["layer0_seconds"] = time.perf_counter() - t0
            print(f"  layer 0 diagnostic ({block['layer0_seconds']:.0f} s): {json.dumps(block['layer0'])}", flush=True)
        block["runs"] = []
        write()
        for name, (mode, bits, _) in specs.items():
            state.tally.reset()
            t0 = time.perf_counter()
            scores = score_block(model, ids, name)
            run = {
                "mode": mode,
                "accumulator": "fp32" if bits is None else f"{bits} bits, layers {args.layers}, {args.gemms}",
                "bits": bits,
                "delta_nll": float(scores.nll.mean() - base.nll.mean()),
                "kl_nats": mean_kl(base, scores),
                "top1_agreement": float((scores.top1 == base.top1).double().mean()),
                "seconds": time.perf_counter() - t0,
            }
            block["runs"].append(run)
            print(
                f"  {name}: delta-NLL {run['delta_nll']:+.5f} KL {run['kl_nats']:.5f} ({run['seconds']:.0f} s)",
                flush=True,
            )
            write()
    write()
    print(args.out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
