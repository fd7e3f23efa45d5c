"""Why e4m3 / MXFP8 attention operands cost so much on a model: a CPU diagnosis on one block.

One exact (fp32 sdpa) forward pass over one short block records every layer's q, k (after RoPE) and v.
Then, per layer, on the recorded tensors (GQA expanded, causal, scores in log2 units
t = q k^T * scale * log2(e), the units of an exp2 softmax):

(a) magnitudes: per head-dim channel max |q|, max |k| (the largest channel, the median channel, which
    channel), the share of k's energy in its mean over tokens (a bias-like, token-independent part),
    and per row the score range: max |t|, max t minus median t;
(b, c, d) for each operand transform (`make_transforms`): bf16; e4m3 at scale 1 on q, k, v one at a time
    and all three; MXFP8 with per-32 E8M0 blocks as the kernel quantizes (Q, K along head_dim, V along keys:
    `fa4_rowmax.reference.fused_softmax.quantize_operands`), one at a time and all three; e4m3 with a
    per-head amax scale; e4m3 / MXFP8 of q, k rotated by an orthonormal Hadamard matrix of the head dim;
    e4m3 / MXFP8 with k replaced by k minus its mean over the block's tokens (and that, rotated):
    - the score error dt = t' - t: its largest deviation from the row's p-weighted mean (dt_max) and its
      spread under the exact softmax p, sqrt(Var_p(dt)) (what the softmax sees: a row-constant error
      cancels), in log2 units;
    - the per-row KL(p || p') of the attention weights (nats) and the attention output's relative error.
    The rotation and the mean shift are exact in exact arithmetic: (qH)(kH)^T = q k^T, and q (k - m)^T
    differs from q k^T by a per-row constant.
(e2e) optionally (--e2e), the block's next-token NLL with every layer's attention replaced by exact fp32
    attention on the transformed operands, against the fp32 sdpa run: delta-NLL, KL, top-1 agreement.

Every quantized variant rounds the operands to bf16 first (the kernels cast bf16 q/k/v). The softmax and
P are exact fp32 everywhere: P's rounding (e4m3 P in `exact_fp8`, MXFP8 P in the fused modes) is not modeled.

    .venv/bin/python -m studies.fp8_operand_error.study --model qwen2.5-1.5b --tokens 512 --e2e \
        --out bench/results/fp8_operand_error_qwen15b.json
"""

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

from fa4_rowmax.reference.fused_softmax import quantize_operands
from fa4_rowmax.reference.mx import fake_quantize_mx

LOG2E = 1.0 / math.log(2.0)
E4M3_MAX = 448.0
E4M3_TINY = 2.0**-6


def hadamard(d: int) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix of size d (a power of two)."""
    if d & (d - 1):
        raise ValueError(f"head dim {d} is not a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).float()


def bf16(x):
    return x.to(torch.bfloat16).float()


def e4m3(x):
    """bf16, then e4m3 at scale 1, saturating at +-448 (fa4_rowmax.hf.to_e4m3)."""
    return bf16(x).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def e4m3_head_amax(x):
    """e4m3 with one fp32 scale per head (dim 0): the head's amax maps to 448."""
    s = bf16(x).abs().amax(dim=(1, 2), keepdim=True).clamp(min=1e-30) / E4M3_MAX
    return e4m3(x / s) * s


def mx_qk(x):
    return fake_quantize_mx(bf16(x), "e4m3", 32, dim=-1)


def mx_v(v):
    return fake_quantize_mx(bf16(v), "e4m3", 32, dim=1)  # (heads, keys, head_dim): blocks of 32 keys


def _ident(x):
    return x


def make_transforms(head_dim: int):
    """name -> f(q, k, v) -> (q', k', v'), all (heads, tokens, head_dim) fp32."""
    h = hadamard(head_dim)

    def rot(f_qk, f_v):
        return lambda q, k, v: (f_qk(q @ h), f_qk(k @ h), f_v(v))

    def ksmooth(q, k, v):
        return e4m3(q), e4m3(k - k.mean(dim=1, keepdim=True)), e4m3(v)

    def kmean_rot(q, k, v):
        return e4m3(q @ h), e4m3((k - k.mean(dim=1, keepdim=True)) @ h), e4m3(v)

    def mxfp8(q, k, v):
        # the kernel's semantics: fused_softmax.quantize_operands on (batch, seqlen, heads, head_dim)
        qq, kq, vq = quantize_operands(*(bf16(x).transpose(0, 1)[None] for x in (q, k, v)), "mxfp8")
        return tuple(x[0].transpose(0, 1) for x in (qq, kq, vq))

    def mxfp8_kmean(q, k, v):
        return mxfp8(q, k - k.mean(dim=1, keepdim=True), v)

    return {
        "fp32": lambda q, k, v: (q, k, v),
        "bf16": lambda q, k, v: (bf16(q), bf16(k), bf16(v)),
        "e4m3_q": lambda q, k, v: (e4m3(q), k, v),
        "e4m3_k": lambda q, k, v: (q, e4m3(k), v),
        "e4m3_v": lambda q, k, v: (q, k, e4m3(v)),
        "e4m3": lambda q, k, v: (e4m3(q), e4m3(k), e4m3(v)),
        "e4m3_head_amax": lambda q, k, v: (e4m3_head_amax(q), e4m3_head_amax(k), e4m3_head_amax(v)),
        "e4m3_hadamard_qk": rot(e4m3, e4m3),
        "e4m3_kmean": ksmooth,
        "e4m3_kmean_hadamard_qk": kmean_rot,
        "mxfp8_q": lambda q, k, v: (mx_qk(q), k, v),
        "mxfp8_k": lambda q, k, v: (q, mx_qk(k), v),
        "mxfp8_v": lambda q, k, v: (q, k, mx_v(v)),
        "mxfp8": mxfp8,
        "mxfp8_hadamard_qk": rot(mx_qk, mx_v),
        "mxfp8_kmean": mxfp8_kmean,
    }


def attention(q, k, v, scale):
    """Causal exact attention, fp32. q (H, T, D), k/v (Hkv, T, D). Returns (out, log2 scores t, log p)."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    t = (q @ k.transpose(1, 2)) * (scale * LOG2E)
    mask = torch.ones(t.shape[-2:], dtype=torch.bool).tril()
    t = t.masked_fill(~mask, float("-inf"))
    logp = torch.log_softmax(t / LOG2E, dim=-1)
    return logp.exp() @ v, t, logp


def magnitudes(q, k, v, scale):
    cq, ck = q.abs().amax(dim=(0, 1)), k.abs().amax(dim=(0, 1))  # per channel
    kmean = k.mean(dim=1, keepdim=True)
    _, t, _ = attention(q, k, v, scale)
    finite = torch.isfinite(t)
    tmax = t.amax(-1)
    tmed = torch.nanmedian(t.masked_fill(~finite, float("nan")), dim=-1).values
    absmax = t.masked_fill(~finite, 0).abs().amax(-1)
    rows = slice(16, None)  # rows with at least 16 keys for the spread
    xs = torch.cat([q.flatten(), k.flatten(), v.flatten()]).abs()
    return {
        "q_chan_max": float(cq.max()),
        "q_chan_median": float(cq.median()),
        "q_top_chan": int(cq.argmax()),
        "k_chan_max": float(ck.max()),
        "k_chan_median": float(ck.median()),
        "k_top_chan": int(ck.argmax()),
        "k_top3_chans": [int(i) for i in ck.topk(3).indices],
        "k_mean_energy_share": float((kmean**2).sum() / (k**2).sum(dim=-1).mean() / k.shape[0]),
        "v_max": float(v.abs().max()),
        "t_absmax_median_row": float(absmax[:, rows].median()),
        "t_absmax_max": float(absmax.max()),
        "t_max_minus_median_median_row": float((tmax - tmed)[:, rows].median()),
        "below_normal_frac": float(((xs > 0) & (xs < E4M3_TINY)).float().mean()),
        "saturated": int((xs > E4M3_MAX).sum()),
    }


def errors(ref, q, k, v, scale):
    o0, t0, logp0 = ref
    o1, t1, logp1 = attention(q, k, v, scale)
    finite = torch.isfinite(t0)
    dt = (t1 - t0).masked_fill(~finite, 0)
    p0 = logp0.exp()
    mean = (p0 * dt).sum(-1, keepdim=True)
    var = (p0 * (dt - mean) ** 2).sum(-1)  # what the softmax sees of the score error (log2 units^2)
    kl = (p0 * (logp0 - logp1).masked_fill(~finite, 0)).sum(-1)
    return {
        "dt_max": float((dt - mean).masked_fill(~finite, 0).abs().max()),
        "dt_spread_rms": float(var.mean().sqrt()),
        "kl_row_mean": float(kl.mean()),
        "kl_row_max": float(kl.max()),
        "out_rel_err": float((o1 - o0).norm() / o0.norm()),
    }


class Probe:
    """A transformers attention function that records q/k/v or runs exact attention on transformed operands."""

    def __init__(self):
        self.record, self.transform, self.tensors, self.layers = False, None, {}, None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if self.record:
            self.tensors[module.layer_idx] = (query[0].clone(), key[0].clone(), value[0].clone(), scaling)
        if self.transform is None or (self.layers is not None and module.layer_idx not in self.layers):
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )
        if query.shape[0] != 1:
            raise ValueError("one block at a time")
        out, _, _ = attention(*self.transform(query[0].float(), key[0].float(), value[0].float()), scaling)
        return out.transpose(0, 1)[None].to(query.dtype).contiguous(), None


def nll_and_logp(model, ids):
    logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1)
    return logp, -logp.gather(-1, ids[1:, None]).squeeze(-1)


def parse_layers(spec: str) -> set[int]:
    """'3' -> {3}; '1-27' -> {1, ..., 27}; '0,2-4' -> {0, 2, 3, 4}."""
    out = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def table(rows, cols, fmt="{:.4g}"):
    head = "| " + " | ".join(cols) + " |\n| " + " | ".join("---" for _ in cols) + " |\n"
    body = "".join(
        "| " + " | ".join(fmt.format(r[c]) if isinstance(r[c], float) else str(r[c]) for c in cols) + " |\n"
        for r in rows
    )
    return head + body


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--assets-dir", type=Path, default=Path(".cache/quality_models"))
    ap.add_argument("--block-size", type=int, default=2048, help="the study's block size (for the block index)")
    ap.add_argument("--block-index", type=int, default=467, help="full-block index; 467 = the study's first scored")
    ap.add_argument("--tokens", type=int, default=512, help="tokens from the start of that block")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--e2e", action="store_true", help="also the block's NLL with each transform in every layer")
    ap.add_argument("--e2e-transforms", nargs="*", default=None)
    ap.add_argument(
        "--e2e-layers", nargs="*", default=["all"], help='layer sets the e2e transforms apply to: "all", "0", "1-27"'
    )
    ap.add_argument("--out", type=Path, required=True, help="JSON path; a .md goes beside it")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from bench.quality.workload import load_from_gguf

    workload = load_from_gguf(None, False, model=args.model, text_name="austen", assets_dir=args.assets_dir)
    model = workload.model
    start = args.block_index * args.block_size
    ids = workload.token_ids[start : start + args.tokens]
    loaded_s = time.perf_counter() - started
    print(f"loaded {args.model} in {loaded_s:.0f} s; tokens [{start}, {start + args.tokens})")

    probe = Probe()
    AttentionInterface.register("fp8_operand_probe", probe)
    AttentionMaskInterface.register("fp8_operand_probe", sdpa_mask)
    model.set_attn_implementation("fp8_operand_probe")

    with torch.no_grad():
        probe.record = True
        logp_ref, nll_ref = nll_and_logp(model, ids)
        probe.record = False
        head_dim = probe.tensors[0][0].shape[-1]
        transforms = make_transforms(head_dim)

        per_layer = []
        for layer, (q, k, v, scale) in sorted(probe.tensors.items()):
            q, k, v = q.float(), k.float(), v.float()
            ref = attention(q, k, v, scale)
            entry = {"layer": layer, **magnitudes(q, k, v, scale), "errors": {}}
            for name, f in transforms.items():
                if name != "fp32":
                    entry["errors"][name] = errors(ref, *f(q, k, v), scale)
            per_layer.append(entry)
            e = entry["errors"]
            print(
                f"layer {layer:2d}: |k| chan max {entry['k_chan_max']:7.1f} (ch {entry['k_top_chan']:3d}, median "
                f"{entry['k_chan_median']:5.1f}), k mean share {entry['k_mean_energy_share']:.2f}, "
                f"|t| {entry['t_absmax_median_row']:6.1f}; dt spread e4m3 {e['e4m3']['dt_spread_rms']:.3f} "
                f"had {e['e4m3_hadamard_qk']['dt_spread_rms']:.3f} kmean {e['e4m3_kmean']['dt_spread_rms']:.3f}; "
                f"KL e4m3 {e['e4m3']['kl_row_mean']:.4f} mxfp8 {e['mxfp8']['kl_row_mean']:.4f}"
            )
        del probe.tensors

        summary = []
        for name in transforms:
            if name == "fp32":
                continue
            vals = [p["errors"][name] for p in per_layer]
            summary.append(
                {
                    "transform": name,
                    "dt_max (max over layers)": max(x["dt_max"] for x in vals),
                    "dt_spread_rms (mean over layers)": sum(x["dt_spread_rms"] for x in vals) / len(vals),
                    "dt_spread_rms (max layer)": max(x["dt_spread_rms"] for x in vals),
                    "KL/row (mean over layers)": sum(x["kl_row_mean"] for x in vals) / len(vals),
                    "KL/row (max layer)": max(x["kl_row_mean"] for x in vals),
                    "out rel err (mean over layers)": sum(x["out_rel_err"] for x in vals) / len(vals),
                }
            )

        e2e = []
        if args.e2e:
            names = args.e2e_transforms or [n for n in transforms]
            for name, layer_set in [(n, s) for n in names for s in args.e2e_layers]:
                t0 = time.perf_counter()
                probe.transform = transforms[name]
                probe.layers = None if layer_set == "all" else parse_layers(layer_set)
                logp, nll = nll_and_logp(model, ids)
                probe.transform, probe.layers = None, None
                kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
                e2e.append(
                    {
                        "transform": name,
                        "layers": layer_set,
                        "delta_nll": float((nll - nll_ref).mean()),
                        "ppl_change_pct": 100 * math.expm1(float((nll - nll_ref).mean())),
                        "kl": float(kl.mean()),
                        "top1_agree_pct": 100 * float((logp.argmax(-1) == logp_ref.argmax(-1)).float().mean()),
                    }
                )
                print(f"e2e {name}: {e2e[-1]} ({time.perf_counter() - t0:.0f} s)")

    result = {
        "what": __doc__.split("\n")[0],
        "settings": {
            "model": args.model,
            "provenance": workload.provenance,
            "tokens": [start, start + args.tokens],
            "block_index": args.block_index,
            "block_size": args.block_size,
            "head_dim": head_dim,
            "baseline_nll": float(nll_ref.mean()),
            "torch": torch.__version__,
            "threads": args.threads,
            "cpu": platform.processor() or platform.machine(),
            "seconds": round(time.perf_counter() - started, 1),
            "load_seconds": round(loaded_s, 1),
        },
        "summary": summary,
        "e2e": e2e,
        "per_layer": per_layer,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")

    mag_cols = [
        "layer",
        "q_chan_max",
        "q_chan_median",
        "k_chan_max",
        "k_chan_median",
        "k_top_chan",
        "k_mean_energy_share",
        "t_absmax_median_row",
        "t_max_minus_median_median_row",
        "below_normal_frac",
    ]
    err_rows = [
        {"layer": p["layer"], **{n: p["errors"][n]["dt_spread_rms"] for n in ("bf16", "e4m3_q", "e4m3_k", "e4m3")}}
        | {n: p["errors"][n]["dt_spread_rms"] for n in ("e4m3_head_amax", "e4m3_hadamard_qk", "e4m3_kmean")}
        | {n: p["errors"][n]["dt_spread_rms"] for n in ("mxfp8", "mxfp8_hadamard_qk", "mxfp8_kmean")}
        for p in per_layer
    ]
    md = (
        f"# FP8 / MXFP8 operand error, {args.model}, one block (CPU)\n\n"
        f"- {workload.provenance['model']}\n- text: Austen, tokens [{start}, {start + args.tokens}) "
        f"(full-block index {args.block_index} of {args.block_size}), head dim {head_dim}\n"
        f"- CPU ({result['settings']['cpu']}), torch {torch.__version__}, {args.threads} thread(s), "
        f"{result['settings']['seconds']} s; command: `.venv/bin/python -m studies.fp8_operand_error.study "
        f"--model {args.model} --tokens {args.tokens} --block-index {args.block_index}"
        f"{' --e2e' if args.e2e else ''}"
        f"{'' if args.e2e_transforms is None else ' --e2e-transforms ' + ' '.join(args.e2e_transforms)}"
        f"{'' if args.e2e_layers == ['all'] else ' --e2e-layers ' + ' '.join(args.e2e_layers)} --out {args.out}`\n"
        "- scores t in log2 units; dt spread = sqrt(Var_p(t' - t)) under the exact softmax p, RMS over rows; "
        "softmax and P exact fp32 (P rounding not modeled); operands rounded to bf16 before any FP8 cast\n\n"
        "## Per transform, over layers\n\n" + table(summary, list(summary[0])) + "\n"
    )
    if e2e:
        md += (
            "## End to end, against fp32 sdpa (transform in every layer unless `layers` says)\n\n"
            + table(e2e, list(e2e[0]))
            + "\n"
        )
    md += "## Magnitudes per layer\n\n" + table(per_layer, mag_cols, "{:.3g}") + "\n"
    md += "## dt spread (log2 units) per layer\n\n" + table(err_rows, list(err_rows[0]), "{:.3g}")
    args.out.with_suffix(".md").write_text(md)
    print(table(summary, list(summary[0])))
    if e2e:
        print(table(e2e, list(e2e[0])))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
