"""The compare routine's report: one line per case while it runs, the comparison table
on the terminal and the markdown tables of docs/perf.md's side-by-side section."""

from __future__ import annotations

from typing import Optional

from ..experts import MOE_LABELS
from ..incumbents import MOE_INCUMBENTS
from ..report import Table, fmt_num, to_markdown, to_text


def fmt_case(r: dict) -> str:
    if r["op"] == "decode":
        ctx = f" {r['context'] // 1024}K" if r["context"] else ""
        return f"{r['model']} {r['kind'].upper()}{ctx} B={r['batch']}"
    if r["op"] == "prefill":
        return f"{r['model']} prefill {r['kind']} T={r['batch']}"
    return f"{r['model']} {r['kind']} M={r['batch']}"


def line(r: dict) -> str:
    """The progress line of one measured case."""
    s = f"{fmt_case(r)}: dsv4 {r['dsv4_us']:.1f} us"
    if "ratio" in r:
        s += f", {r['incumbent']} {r['incumbent_us']:.1f} us, ratio {r['ratio']:.2f}x, max|diff| {r['maxdiff']:.3g}"
    if "incumbent_experts_us" in r:
        s += f" ({r['incumbent_path']}; its GEMMs alone {r['incumbent_experts_us']:.1f} us: {r['ratio_experts']:.2f}x)"
    if "invariant_us" in r:
        s += f", batch-invariant {r['invariant_us']:.1f} us ({r['invariant_cost']:.2f}x dsv4)"
    if "predecessor_us" in r:
        s += f" (pair - GEMM); GEMM alone {r['predecessor_us']:.1f} us, pairs: dsv4 {r['pair_us']:.1f} us"
        if "incumbent_pair_us" in r:
            s += f", {r['incumbent']} {r['incumbent_pair_us']:.1f} us, ratio {r['ratio_pair']:.2f}x"
    return s


def _ceilings_line(ceilings: Optional[dict]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in ceilings.items())


def render(rows: list[dict], anchors_line: str, ceilings: Optional[dict] = None) -> str:
    """The comparison table as plain text, the incumbents line (and the ceilings) first."""
    t = Table("dsv4 vs the kernels vLLM 0.33.0 runs on Hopper (ratio = incumbent us / dsv4 us)",
              ["case", "dsv4 us", "TFLOP/s", "incumbent", "incumbent us", "ratio", "max|diff|"], align="lrrlrrr")
    for r in rows:
        have = "ratio" in r
        t.rows.append([fmt_case(r), fmt_num(r.get("dsv4_us")), fmt_num(r.get("tflops"), ".0f"),
                       r.get("incumbent", "missing"), fmt_num(r["incumbent_us"]) if have else "-",
                       f"{r['ratio']:.2f}x" if have else "-", f"{r['maxdiff']:.3g}" if have else "-"])
    lines = [anchors_line] + ([f"ceilings (same process): {_ceilings_line(ceilings)}"] if ceilings else [])
    return to_text([t], 140, lines)


def _ratio(r: dict) -> str:
    if "ratio" not in r:
        return "-"
    return f"**{r['ratio']:.2f}x**" if r["ratio"] < 1.0 else f"{r['ratio']:.2f}x"


def _moe_incumbent_label(kind: str) -> str:
    return next((v for case, v in MOE_INCUMBENTS.items() if MOE_LABELS[case] == kind), "no incumbent")


def _nan(r: dict, key: str, spec: str = ".1f") -> str:
    return format(r.get(key, float("nan")), spec)


# --predecessor rows: the GEMM alone and the two pairs (GEMM + attention), timed in one call.
_PAIR_COLUMNS = ["GEMM us", "dsv4 pair us", "FlashMLA pair us", "ratio of pairs"]


def _pair_cells(r: dict) -> list[str]:
    rp = f"{r['ratio_pair']:.2f}x" if "ratio_pair" in r else "-"
    return [_nan(r, "predecessor_us"), _nan(r, "pair_us"), _nan(r, "incumbent_pair_us"), rp]


def tables(rows: list[dict]) -> list[Table]:
    """The markdown tables of compared rows, one per op (and per MoE mode)."""
    out = []
    moe_kinds = list(dict.fromkeys(r["kind"] for r in rows if r["op"] == "moe"))
    sections = [("decode", None, "Decode attention (s_q = 1), dsv4 vs FlashMLA SM90"),
                ("prefill", None, "Sparse prefill, dsv4 vs FlashMLA SM90")]
    sections += [("moe", k, f"Routed-expert MoE ({k}), dsv4 vs {_moe_incumbent_label(k)}") for k in moe_kinds]
    for op, kind, title in sections:
        sel = [r for r in rows if r["op"] == op and (kind is None or r["kind"] == kind)]
        if not sel:
            continue
        pre = any("predecessor_us" in r for r in sel)
        if pre:
            title += " after V4's q-projection GEMM (us = pair - GEMM alone)"
        if op == "decode":
            t = Table(title, ["model", "layer", "context", "B", "dsv4 us", "FlashMLA us", "ratio", "dsv4 TFLOP/s",
                              "% bf16 peak"] + _PAIR_COLUMNS * pre, align="lllrrrrrr" + "rrrr" * pre)
            for r in sel:
                ctx = f"{r['context'] // 1024}K" if r.get("context") else "any"
                t.rows.append([r["model"], r["kind"].upper(), ctx, r["batch"], f"{r['dsv4_us']:.1f}",
                               _nan(r, "incumbent_us"), _ratio(r), _nan(r, "tflops", ".0f"),
                               _nan(r, "pct_gemm", ".0f")] + _pair_cells(r) * pre)
        elif op == "prefill":
            t = Table(title, ["model", "indices", "T", "dsv4 us", "FlashMLA us", "ratio", "ratio incl. gather (est.)",
                              "dsv4 TFLOP/s", "% bf16 peak"] + _PAIR_COLUMNS * pre, align="llrrrrrrr" + "rrrr" * pre)
            for r in sel:
                rg = f"{r['ratio_with_gather']:.2f}x" if "ratio_with_gather" in r else "-"
                t.rows.append([r["model"], r["keys"], r["batch"], f"{r['dsv4_us']:.1f}", _nan(r, "incumbent_us"),
                               _ratio(r), rg, _nan(r, "tflops", ".0f"), _nan(r, "pct_gemm", ".0f")]
                              + _pair_cells(r) * pre)
        else:
            # "Humming us" is vLLM's whole call (routing prep, GEMMs, weighted sum), as dsv4's;
            # "GEMMs alone" the Humming GEMMs without them (the number of record before 2026-12-04)
            of = {r.get("pct_gemm_of", "bf16") for r in sel}
            peak = f"% {of.pop()} peak" if len(of) == 1 else "% bf16 / fp8 peak"
            t = Table(title, ["experts", "M", "dsv4 us", "Humming us", "ratio", "GEMMs alone us", "ratio to them",
                              "dsv4 TFLOP/s", peak, "dsv4 TB/s (weights)", "% copy", "rel. L2 vs Humming"])
            for r in sel:
                l2 = f"{r['rel_l2']:.1e}" if "rel_l2" in r else "-"
                re = f"{r['ratio_experts']:.2f}x" if "ratio_experts" in r else "-"
                t.rows.append([r["model"], r["batch"], f"{r['dsv4_us']:.1f}", _nan(r, "incumbent_us"), _ratio(r),
                               _nan(r, "incumbent_experts_us"), re, f"{r['tflops']:.0f}", _nan(r, "pct_gemm", ".0f"),
                               f"{r['tbps']:.2f}", _nan(r, "pct_copy", ".0f"), l2])
        out.append(t)
    return out


def markdown(rows: list[dict], ceilings: Optional[dict] = None) -> str:
    """Markdown tables of compared rows, one per op (docs/perf.md's side-by-side tables)."""
    pre = [f"Ceilings measured in the same process: {_ceilings_line(ceilings)}."] if ceilings else []
    return to_markdown(tables(rows), heading="h4", preamble=pre)
