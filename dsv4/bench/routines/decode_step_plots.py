"""The decode-step routine's plots (matplotlib, Agg): latency per layer vs batch, the
stacked step breakdown, and with ``--vs vllm`` the per-case ratio to vLLM's kernels."""

from __future__ import annotations

from ..experts import MOE_LABELS
from ..incumbents import MOE_INCUMBENTS
from ..report import fmt_ctx
from .decode_step_sweep import KIND_LABEL, Sweep
from .decode_step_tables import find


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> None:
    """The figure as a 256-colour PNG: the plots have a few flat colours, and RGBA at 110 dpi
    took ~1.2 MB for the six committed under docs/decode_latency/ (a third of the tracked
    tree, which every GPU-machine call carries: tests/test_serve_smoke.py's budget)."""
    import io

    from PIL import Image  # matplotlib's own dependency

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def _cpu_title(sweep: Sweep) -> str:
    return "\nCPU reference run: float32 reference kernels vs torch on tiny shapes; times are not performance" \
        if sweep.cpu else ""


def plot_components(sweep: Sweep, path: str) -> None:
    plt = _pyplot()
    a = sweep.args
    comps = ["attn_swa", "attn_csa", "attn_hca", "moe"]
    ours = "reference" if sweep.cpu else "dsv4"
    fig, axes = plt.subplots(len(a.models), 4, figsize=(18, 4.2 * len(a.models)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, m in enumerate(a.models):
        for j, comp in enumerate(comps):
            ax = axes[i][j]
            if comp == "moe":
                series = [(MOE_LABELS[(f, act)], dict(component=comp, format=f, activation=act)) for f, act in a.moe]
            elif comp == "attn_swa":
                series = [("any ctx", dict(component=comp, context=None))]
            else:
                series = [(fmt_ctx(c), dict(component=comp, context=c)) for c in a.context]
            for k, (lab, key) in enumerate(series):
                rs = [find(sweep.rows, model=m, batch=b, **key) for b in a.batch]
                for impl, style in (("dsv4", "o-"), ("torch", "s--")):
                    if comp == "moe" and impl == "torch" and k > 0:
                        continue  # one baseline line: it does not depend on the format or activation mode
                    pts = [(b, r[impl + "_us"]) for b, r in zip(a.batch, rs) if r and r.get(impl + "_us")]
                    if pts:
                        name = f"{ours} {lab}" if impl == "dsv4" else (f"torch {lab}" if comp != "moe" else
                                                                      "torch bf16 grouped-GEMM")
                        ax.plot(*zip(*pts), style, color=colors[k % len(colors)] if impl == "dsv4" or comp != "moe"
                                else "black", label=name, alpha=1.0 if impl == "dsv4" else 0.6)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(a.batch, [str(b) for b in a.batch])
            ax.set_xlabel("batch (sequences decoding)")
            ax.set_ylabel("us per layer" + (" (CPU wall time)" if sweep.cpu else ""))
            ax.set_title(f"{sweep.shapes[m].name}: {KIND_LABEL[comp.replace('attn_', '')]}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    fig.suptitle(f"Decode latency per layer: {ours} kernels (solid) vs torch baselines (dashed)" + _cpu_title(sweep))
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_vllm_ratio(sweep: Sweep, path: str) -> bool:
    """Per-case ratio vLLM 0.33 kernels time / dsv4 time vs batch (> 1: dsv4 faster).
    Returns False (no file) when nothing was compared."""
    a = sweep.args
    if not any(r.get("vllm_us") for r in sweep.rows):
        return False
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(a.models), figsize=(8 * len(a.models), 4.5), squeeze=False)
    for i, m in enumerate(a.models):
        ax = axes[0][i]
        series = [("SWA", dict(component="attn_swa", context=None))]
        series += [(f"{k.upper()} {fmt_ctx(c)}", dict(component="attn_" + k, context=c))
                   for k in ("csa", "hca") for c in a.context]
        series += [(f"MoE {MOE_LABELS[c]}", dict(component="moe", format=c[0], activation=c[1]))
                   for c in a.moe if c in MOE_INCUMBENTS]
        for lab, key in series:
            pts = [(b, r["vllm_us"] / r["dsv4_us"]) for b in a.batch
                   for r in [find(sweep.rows, model=m, batch=b, **key)] if r and r.get("vllm_us") and r.get("dsv4_us")]
            if pts:
                ax.plot(*zip(*pts), "s-" if "MoE" in lab else "o-", label=lab, linewidth=2 if "MoE" in lab else 1)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(a.batch, [str(b) for b in a.batch])
        ax.set_xlabel("batch (sequences decoding)")
        ax.set_ylabel("vLLM 0.33 kernel time / dsv4 time")
        ax.set_title(f"{sweep.shapes[m].name}: > 1 = dsv4 faster (FlashMLA SM90, Humming)", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return True


def step_yscale(totals) -> str:
    """'log' when the tallest bar is over 20x the shortest, so that both stay visible (a
    CPU reference run: float32 reference kernels vs torch); else 'linear', where the
    stacked parts read in proportion."""
    pos = [t for t in totals if t > 0]
    return "log" if pos and max(pos) > 20 * min(pos) else "linear"


def plot_steps(sweep: Sweep, steps: list[dict], path: str) -> None:
    plt = _pyplot()
    a = sweep.args
    case = a.moe[0]
    ours = "reference" if sweep.cpu else "dsv4"
    parts = [("swa_us", "SWA attn"), ("csa_us", "CSA attn"), ("hca_us", "HCA attn"), ("moe_us", "routed MoE")]
    colors = ["#8da0cb", "#66c2a5", "#fc8d62", "#e78ac3"]
    fig, axes = plt.subplots(len(a.models), 1, figsize=(max(10, 1.1 * len(a.batch) * len(a.context) + 2),
                                                        4.5 * len(a.models)), squeeze=False)
    for i, m in enumerate(a.models):
        ax = axes[i][0]
        labels, totals = [], []
        for x, (ctx, b) in enumerate((c, b) for c in a.context for b in a.batch):
            st = find(steps, model=m, format=case[0], activation=case[1], batch=b, context=ctx)
            labels.append(f"B={b}\n{fmt_ctx(ctx)}")
            for impl, dx, hatch in (("dsv4", -0.2, None), ("torch", 0.2, "//")):
                est = st[impl]
                if not est:
                    continue
                bottom = 0.0
                for (key, name), c in zip(parts, colors):
                    v = est[key] / 1e3
                    ax.bar(x + dx, v, 0.38, bottom=bottom, color=c, hatch=hatch, edgecolor="white" if hatch else c,
                           label=name if (x == 0 and impl == "dsv4") else None)
                    bottom += v
                ax.text(x + dx, bottom, f"{bottom:.2f}", ha="center", va="bottom", fontsize=6, rotation=90)
                totals.append(bottom)
        scale = step_yscale(totals)
        if scale == "log":  # room below the shortest total and above the labels of the tallest
            ax.set_yscale("log")
            ax.set_ylim(min(t for t in totals if t > 0) / 4, max(totals) * 4)
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set_ylabel("ms per decode step" + (" (CPU wall time)" if sweep.cpu else "")
                      + (", log scale" if scale == "log" else ""))
        lay = sweep.shapes[m].layers
        ax.set_title(f"{sweep.shapes[m].name}: estimated decode step, left bar {ours}, right (hatched) bar torch\n"
                     f"MoE {MOE_LABELS[case]} EP{a.ep}; {lay['swa']} SWA + {lay['csa']} CSA + {lay['hca']} HCA layers; "
                     "kernels only" + _cpu_title(sweep), fontsize=9)
        if scale == "linear":
            ax.margins(y=0.12)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
