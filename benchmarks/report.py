"""Renders benchmark results (`benchmarks/results/*.json`) as Markdown tables
and PNG plots. Pure rendering: it measures nothing.

`docs/benchmarks.md` is generated; the hand-written analysis lives in
`benchmarks/notes.md` (the analysis of these runs) and
`benchmarks/notes_end.md` (sections measured by other scripts), included
verbatim.
"""

import glob
import json
import math
import os
import re
import statistics

FAMILY_ORDER = ["dense", "resnet_cnn", "transformer", "unet", "resnet50v2", "densenet121"]
DEFAULT = "graphckpt default"
NOTES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "notes.md")
# Sections measured by other scripts (planning time, the MILP gap, JAX and
# PyTorch beside their native peers): written by hand, included at the end.
NOTES_END = os.path.join(os.path.dirname(os.path.abspath(__file__)), "notes_end.md")


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(runs):
    """Per method: medians over rounds of the ratios to the same round's
    baseline, plus median raw figures and any error."""
    base = {r["round"]: r for r in runs if r["label"] == "baseline" and r["ok"]}
    out = {}
    for label in dict.fromkeys(r["label"] for r in runs):
        mine = [r for r in runs if r["label"] == label]
        good = [r for r in mine if r["ok"]]

        def ratios(key, good=good):
            return [
                r[key] / base[r["round"]][key]
                for r in good
                if r["round"] in base and r[key] is not None and base[r["round"]][key]
            ]

        bad = next((r for r in mine if not r["ok"]), None)
        base_best = min((t for r in base.values() for t in r.get("step_times_s") or ()), default=None)
        best = min((t for r in good for t in r.get("step_times_s") or ()), default=None)
        out[label] = {
            "ok": bool(good) and bad is None,
            "rounds": len(good),
            "peak_bytes": _median(r["peak_bytes"] for r in good),
            "step_time_s": _median(r["step_time_s"] for r in good),
            "step_cpu_s": _median(r["step_cpu_s"] for r in good),
            "peak_ratio": _median(ratios("peak_bytes")),
            "time_ratio": _median(ratios("step_time_s")),
            "cpu_ratio": _median(ratios("step_cpu_s")),
            # Fastest step of all rounds over the baseline's fastest: the
            # figure least disturbed by other load on a shared machine.
            "best_time_ratio": best / base_best if best and base_best else None,
            "time_ratios": ratios("step_time_s"),
            "num_segments": good[0]["num_segments"] if good else None,
            "error": bad["error"] if bad else None,
            "phase": bad["phase"] if bad else None,
        }
    return out


KINDS = ("family", "acceptance", "scaling")


# Reruns of the default plan alone (baseline and `graphckpt default`, each
# round side by side), written by `run_all.py --methods "graphckpt default"
# --out benchmarks/results/default_plan`: when the default plan changes, its
# rows are rerun without rerunning every other method.
DEFAULT_RERUNS = "default_plan"


def load(folder):
    """name -> payload for every run_all.py results JSON in `folder` (other
    scripts' results there are skipped). A family's `graphckpt default` row
    comes from its rerun in `folder/default_plan/` where there is one
    (`payload["default_rerun"]`), against that rerun's own baselines."""
    out = _payloads(folder)
    for name, rerun in _payloads(os.path.join(folder, DEFAULT_RERUNS)).items():
        if name in out and DEFAULT in rerun["summary"]:
            out[name]["summary"][DEFAULT] = rerun["summary"][DEFAULT]
            out[name]["default_rerun"] = rerun
    return out


def _payloads(folder):
    """name -> payload of the run_all.py results JSONs in `folder` (none
    where it does not exist)."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            payload = json.load(f)
        if isinstance(payload, dict) and payload.get("kind") in KINDS:
            if payload["kind"] != "scaling":
                payload["summary"] = summarize(payload["runs"])  # results of older versions too
            out[os.path.splitext(os.path.basename(path))[0]] = payload
    return out


def _mib(n):
    return "-" if n is None else f"{n / 2**20:.1f}"


def _secs(t):
    return "-" if t is None else f"{t:.3f}"


def _x(r):
    return "-" if r is None else f"x{r:.2f}"


def _families(results):
    names = [n for n in FAMILY_ORDER if n in results] + [
        n for n, p in results.items() if p.get("kind") == "family" and n not in FAMILY_ORDER
    ]
    return [(n, results[n]) for n in names if results[n].get("kind") == "family"]


def verdict(payload):
    """(peak met, time met) for the default plan against the family target."""
    t = payload.get("target")
    s = payload["summary"].get(DEFAULT)
    if not t or not s or not s["ok"]:
        return None, None
    peak_ok = s["peak_ratio"] < t["peak_ratio"] if t["strict_peak"] else s["peak_ratio"] <= t["peak_ratio"]
    return peak_ok, s["time_ratio"] <= t["time_ratio"]


def family_table(payload):
    lines = [
        "| method | peak MiB | peak ratio | time ratio (median) | time ratio (best) | CPU-time ratio "
        "| Segment layers | status |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, s in payload["summary"].items():
        if s["ok"]:
            status = "ok" if s["rounds"] > 1 else "ok (1 round)"
        else:
            status = f"**failed** in {s['phase']}: `{_short(s['error'])}`"
        segs = s["num_segments"] if s["num_segments"] is not None else "-"
        lines.append(
            f"| {label} | {_mib(s['peak_bytes'])} | {_x(s['peak_ratio'])} | {_x(s['time_ratio'])} | "
            f"{_x(s.get('best_time_ratio'))} | {_x(s['cpu_ratio'])} | {segs} | {status} |"
        )
    return "\n".join(lines)


def source_note(payload):
    """Which graphckpt code the family's runs used (recorded per run)."""
    seen = {}
    for r in payload["runs"]:
        src = (r.get("info") or {}).get("graphckpt_source")
        if src:
            seen.setdefault(src["sha256"], src)
    if not seen:
        return "graphckpt source not recorded (results older than the fingerprint)"
    parts = []
    for sha, src in seen.items():
        git = f", git {src['git_head']}" + (" + uncommitted changes" if src.get("uncommitted_changes") else "")
        parts.append(f"`{sha}`" + (git if src.get("git_head") else ""))
    lead = "graphckpt source " if len(seen) == 1 else f"**{len(seen)} different graphckpt sources** across runs: "
    note = lead + "; ".join(parts)
    rerun = payload.get("default_rerun")
    if rerun:
        note += (
            f". The `{DEFAULT}` row was rerun on {rerun['date'][:10]} ({rerun['settings']['repeats']} rounds, "
            f"each beside its own baseline, {source_note(rerun)}; `run_all.py --families {payload['family']} "
            f"--methods '{DEFAULT}' --repeats {rerun['settings']['repeats']} --out benchmarks/results/{DEFAULT_RERUNS}`)"
        )
    return note


def _title(payload):
    """The run's title, without the issue number older runs recorded in it."""
    return re.sub(r" \(issue \d+\)", "", payload["title"])


def _short(error, n=160):
    error = (error or "").replace("|", "/").replace("`", "'")
    return error if len(error) <= n else error[: n - 3] + "..."


def targets_table(results):
    lines = [
        "| model | target peak | measured peak | target time | time (median) | time (best) | CPU-time | met? |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    rows = [(n, p) for n, p in _families(results)]
    if "acceptance" in results:
        rows.append(("acceptance", results["acceptance"]))
    for name, p in rows:
        t, s = p.get("target"), p["summary"].get(DEFAULT)
        if not t or not s:
            continue
        peak_ok, time_ok = verdict(p)
        if peak_ok is None:
            met = "**failed to run**"
        elif peak_ok and time_ok:
            met = "met"
        else:
            missed = [w for w, ok in (("memory", peak_ok), ("time", time_ok)) if not ok]
            met = "**missed** (" + ", ".join(missed) + ")"
        cmp = "<" if t["strict_peak"] else "<="
        lines.append(
            f"| {name} (batch {p['batch_size']}) | {cmp} x{t['peak_ratio']:.2f} | x{s['peak_ratio']:.3f} | "
            f"<= x{t['time_ratio']:.2f} | {_x(s['time_ratio'])} | {_x(s.get('best_time_ratio'))} | "
            f"{_x(s['cpu_ratio'])} | {met} |"
        )
    return "\n".join(lines)


def tail_exponent(fit, last=3):
    """Log-log slope over the `last` deepest points: less bent by the
    depth-independent part of the peak (weight gradients, the batch)."""
    xs, ys = fit["depths"][-last:], fit["peak_bytes"][-last:]
    if len(xs) < 2:
        return None
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def scaling_table(payload):
    fits = payload["fits"]
    labels = list(fits)
    depths = sorted({d for f in fits.values() for d in f["depths"]})
    lines = ["| depth | " + " | ".join(f"{lab} peak MiB" for lab in labels) + " | ratio |", "|---:|" + "---:|" * (len(labels) + 1)]
    for d in depths:
        vals = []
        for lab in labels:
            f = fits[lab]
            vals.append(f["peak_bytes"][f["depths"].index(d)] if d in f["depths"] else None)
        ratio = vals[-1] / vals[0] if len(vals) > 1 and vals[0] and vals[-1] else None
        lines.append(f"| {d} | " + " | ".join(_mib(v) for v in vals) + f" | {_x(ratio)} |")
    lines.append(
        "| **fitted exponent, all depths** | "
        + " | ".join("-" if fits[lab]["exponent"] is None else f"**{fits[lab]['exponent']:.2f}**" for lab in labels)
        + " | |"
    )
    tails = [tail_exponent(fits[lab]) for lab in labels]
    if all(t is not None for t in tails):
        deep = fits[labels[0]]["depths"][-3:]
        lines.append(
            f"| fitted exponent, depths {deep[0]}-{deep[-1]} | " + " | ".join(f"{t:.2f}" for t in tails) + " | |"
        )
    return "\n".join(lines)


def text_tables(results):
    parts = []
    for name, p in _families(results) + ([("acceptance", results["acceptance"])] if "acceptance" in results else []):
        parts.append(f"\n## {name}: {_title(p)} (batch {p['batch_size']})\n\n{family_table(p)}")
    if "scaling" in results:
        parts.append(f"\n## scaling (batch {results['scaling']['batch_size']})\n\n{scaling_table(results['scaling'])}")
    if any(p.get("target") for _, p in _families(results)) or "acceptance" in results:
        parts.append(f"\n## targets\n\n{targets_table(results)}")
    return "\n".join(parts)


# --------------------------------------------------------------- plots

_STYLE = {
    "RematScope full": ("#9e9e9e", "v"),
    "RematScope activations": ("#757575", "^"),
    "RematScope larger_than": ("#bdbdbd", "<"),
    "RematScope list_of_layers": ("#616161", ">"),
    "whole-model keras.remat": ("#ff9800", "s"),
    "equal segments (sqrt)": ("#1e88e5", "D"),
    DEFAULT: ("#d81b60", "*"),
    "graphckpt budget=sqrt": ("#43a047", "P"),
    "graphckpt budget=min": ("#8e24aa", "X"),
    "graphckpt budget=0.5": ("#00897b", "h"),
    "graphckpt save_expensive": ("#6d4c41", "p"),
}


def _style(label, i):
    if label in _STYLE:
        return _STYLE[label]
    return (["#43a047", "#8e24aa", "#00897b", "#6d4c41"][i % 4], "P")


def plot_tradeoff(results, path):
    """Peak ratio against time ratio, one panel per family, one marker per
    method; the family's target region is shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = _families(results)
    if not fams:
        return None
    cols = 3
    rows = math.ceil(len(fams) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.4 * rows), squeeze=False)
    handles = {}
    for ax, (name, p) in zip(axes.flat, fams):
        t = p.get("target")
        xmax, ymax = 1.6, 1.15
        for s in p["summary"].values():
            if s["ok"] and s["time_ratio"]:
                xmax = max(xmax, s["time_ratio"] * 1.08)
                ymax = max(ymax, s["peak_ratio"] * 1.08)
        if t:
            ax.add_patch(
                plt.Rectangle((0, 0), t["time_ratio"], t["peak_ratio"], color="#c8e6c9", alpha=0.6, zorder=0)
            )
        ax.axhline(1, color="#999", lw=0.8, ls=":")
        ax.axvline(1, color="#999", lw=0.8, ls=":")
        failed = []
        for i, (label, s) in enumerate(p["summary"].items()):
            if label == "baseline":
                continue
            if not s["ok"]:
                failed.append(label.replace("RematScope ", ""))
                continue
            color, marker = _style(label, i)
            size = 260 if label == DEFAULT else 90
            h = ax.scatter(s["time_ratio"], s["peak_ratio"], c=color, marker=marker, s=size, edgecolors="black",
                           linewidths=0.6, zorder=3, label=label)
            handles.setdefault(label, h)
        h = ax.scatter(1, 1, c="white", marker="o", s=70, edgecolors="black", zorder=3, label="baseline")
        handles.setdefault("baseline", h)
        ax.set_xlim(0.8, xmax)
        ax.set_ylim(0, ymax)
        ax.set_title(f"{name} (batch {p['batch_size']})", fontsize=11)
        ax.set_xlabel("step time / baseline (wall clock, median)")
        ax.set_ylabel("peak memory / baseline")
        ax.grid(alpha=0.3)
        if failed:
            ax.text(0.98, 0.97, "failed: " + ", ".join(failed), transform=ax.transAxes, ha="right", va="top",
                    fontsize=8, color="#b71c1c", wrap=True)
    for ax in list(axes.flat)[len(fams):]:
        ax.axis("off")
    patch = plt.Rectangle((0, 0), 1, 1, color="#c8e6c9")
    labels = list(handles) + ["target (default plan)"]
    fig.legend(list(handles.values()) + [patch], labels, loc="lower center", ncol=5, fontsize=9, frameon=False)
    fig.suptitle("Peak training-step memory vs step time, relative to no checkpointing (lower-left is better)")
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_scaling(payload, path):
    """Peak memory against depth on log-log axes, with fitted slopes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    colors = {"baseline": "#424242", DEFAULT: "#d81b60"}
    for label, f in payload["fits"].items():
        xs, ys = f["depths"], [y / 2**20 for y in f["peak_bytes"]]
        if not xs:
            continue
        e = f["exponent"]
        ax.plot(xs, ys, "o-", color=colors.get(label, "#1e88e5"), lw=2, ms=7,
                label=f"{label}: slope {e:.2f}" if e is not None else label)
    xs = payload["fits"]["baseline"]["depths"]
    if xs:
        y0 = payload["fits"]["baseline"]["peak_bytes"][0] / 2**20
        for slope, ls in ((1.0, "--"), (0.5, ":")):
            ax.plot(xs, [y0 * (x / xs[0]) ** slope for x in xs], ls, color="#9e9e9e", lw=1,
                    label=f"slope {slope:g} (reference)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    lo, hi = ax.get_ylim()
    ticks = [2**k for k in range(math.floor(math.log2(lo)), math.ceil(math.log2(hi)) + 1)]
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{t:g}" for t in ticks])
    ax.set_ylim(lo, hi)
    ax.minorticks_off()
    ax.set_xlabel("depth (Dense layers)")
    ax.set_ylabel("peak training-step memory above resident (MiB)")
    ax.set_title(f"Dense(1024, tanh) chain, batch {payload['batch_size']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------- docs


def _meta(results):
    any_p = next(iter(results.values()))
    m, v = any_p["machine"], any_p.get("versions", {})
    dates = sorted(p["date"] for p in results.values())
    loads = [p.get("load_avg_start") for p in results.values() if p.get("load_avg_start")]
    cores = m["cpu_count"]
    return (
        f"- Date: {dates[0]} to {dates[-1]} (UTC)\n"
        f"- Machine: {m.get('cpu_model') or m.get('processor')}, {m['cpu_count']} cores, "
        f"{m.get('mem_total_kib', 0) / 2**20:.0f} GiB; {m['platform']}\n"
        f"- Versions: Python {v.get('python')}, TensorFlow {v.get('tensorflow')}, Keras {v.get('keras')}, "
        f"NumPy {v.get('numpy')}, graphckpt {v.get('graphckpt')}\n"
        f"- Settings: {any_p['settings']['steps']} measured steps after {any_p['settings']['warmup']} warm-up "
        f"steps per run, optimizer SGD, loss MSE, `jit_compile={any_p['settings']['jit_compile']}`\n"
        f"- Machine load (1-min load average at the start of each family): "
        + ", ".join(f"{ld[0]:.1f}" for ld in loads)
        + f" on {cores} cores"
        + (
            ": the machine was shared, so step times are noisy; memory figures are not.\n"
            if max(ld[0] for ld in loads) > cores
            else " (at or below the core count: little besides the benchmark ran).\n"
        )
    )


def write_docs(results, root):
    img = os.path.join(root, "docs", "img")
    os.makedirs(img, exist_ok=True)
    written = []
    if plot_tradeoff(results, os.path.join(img, "bench_tradeoff.png")):
        written.append(os.path.join(img, "bench_tradeoff.png"))
    if "scaling" in results:
        written.append(plot_scaling(results["scaling"], os.path.join(img, "bench_scaling.png")))
    parts = [
        "# Benchmarks\n",
        "<!-- Generated by benchmarks/run_all.py (benchmarks/report.py); edit benchmarks/notes.md and notes_end.md instead. -->\n",
        "Peak training-step memory and step time of every model family, with graphckpt and with the "
        "alternatives, all measured the same way in one run per family. Reproduce with `make bench` "
        "(or `.venv/bin/python benchmarks/run_all.py`; `--quick` for a smoke run, `--families dense,scaling` "
        "for a subset). Raw figures: `benchmarks/results/*.json`.\n",
        "## How it is measured\n",
        "Each figure comes from `graphckpt.measure`, in a fresh Python process per run: the model is rebuilt "
        "from its recipe in `benchmarks/families.py`, transformed by the method, compiled with SGD and MSE, and "
        "trained with `train_on_batch` on a fixed random batch. With `TF_CPU_ALLOCATOR_USE_BFC=true` set before "
        "TensorFlow is imported, `tf.config.experimental.get_memory_info('CPU:0')` gives real allocator figures. "
        "**Peak** is the allocator's peak during a training step minus the bytes in use just before it "
        "(weights, optimizer state, the batch): the memory the step itself needs. **Step time** is the median "
        "wall time of the measured steps. Every method of a family is measured round-robin in each round; "
        "a **ratio** is the median over rounds of the method's figure over the same round's baseline. "
        "**CPU-time ratio** uses process CPU time instead of wall time; it is less disturbed by other load on "
        "a shared machine. A method that fails is recorded once with its error and not retried. "
        "**Segment layers** counts the graphckpt `Segment` layers of the trained model (runs a budget plan keeps "
        "inline are not counted; 0 means graphckpt returned the model unchanged).\n",
        "Methods:\n",
        "- **baseline**: the model as built.\n"
        "- **RematScope full / activations / larger_than / list_of_layers**: Keras's own `keras.RematScope`, "
        "active while the model is built (it must be: it is read at layer construction). `larger_than` uses "
        "Keras's default threshold (1024 elements); `list_of_layers` names every layer with a kernel, and "
        "attention.\n"
        "- **whole-model keras.remat**: the model called through one `keras.remat` (training bound by closure). "
        "Naive: no random-state snapshot, so it is not exact with Dropout or BatchNorm.\n"
        "- **equal segments (sqrt)**: the analogue of `torch.utils.checkpoint.checkpoint_sequential`: "
        "round(sqrt(n)) runs of equal length over Keras's execution order, no preference for cheap cuts, "
        "through graphckpt's exact `Segment` layer (so only the cuts differ from graphckpt's default).\n"
        "- **graphckpt default**: `graphckpt.checkpoint_model(model)` (`segments='auto'`): the "
        "plan of least recompute among those whose estimated peak is within 1% of the least any plan reaches, "
        "boundaries where few bytes cross.\n"
        "- **graphckpt budget=sqrt / min / 0.5**: `checkpoint_model(model, budget=..., batch_size=...)`, the "
        "plan of least recompute whose *estimated* peak fits: `sqrt` is the sqrt plan's own estimated peak "
        "(same memory, less recompute expected), `min` the smallest estimated peak of any plan, `0.5` half the "
        "estimated baseline (an infeasible budget is recorded as a failure).\n"
        "- **graphckpt save_expensive**: `checkpoint_model(model, policy='save_expensive')`: Dense, "
        "convolutions and attention are never recomputed, only the cheap calls between them.\n",
        "## Run\n",
        _meta(results),
    ]
    if os.path.exists(os.path.join(root, "docs", "estimator.md")):
        parts.append("Estimated against measured peaks, and the budget-plan runs: "
                     "[estimator.md](estimator.md).\n")
    parts += ["## Targets (graphckpt default plan vs baseline, same run)\n", targets_table(results) + "\n"]
    if os.path.exists(NOTES):
        with open(NOTES) as f:
            parts.append(f.read().strip() + "\n")
    parts += [
        "## Memory vs time, every method\n",
        "![peak memory ratio against step-time ratio per method](img/bench_tradeoff.png)\n",
    ]
    for name, p in _families(results):
        parts.append(f"### {name}: {_title(p)}\n\nBatch {p['batch_size']}, {p['settings']['repeats']} rounds. "
                     f"Baseline peak {_mib(p['summary']['baseline']['peak_bytes'])} MiB, step "
                     f"{p['summary']['baseline']['step_time_s'] or 0:.3f} s; {source_note(p)}.\n\n"
                     f"{family_table(p)}\n")
    if "acceptance" in results:
        p = results["acceptance"]
        parts.append(f"### acceptance: {_title(p)}\n\nBatch {p['batch_size']}, {p['settings']['repeats']} "
                     f"rounds (the acceptance run); {source_note(p)}.\n\n{family_table(p)}\n")
    if "scaling" in results:
        s = results["scaling"]
        parts += [
            "## Scaling: peak memory vs depth\n",
            f"Dense(1024, tanh) chains of increasing depth, batch {s['batch_size']}; the exponent is the "
            f"least-squares slope of log(peak) against log(depth); {source_note(s)}.\n",
            scaling_table(s) + "\n",
            "![peak memory against depth, log-log](img/bench_scaling.png)\n",
        ]
    if os.path.exists(NOTES_END):
        with open(NOTES_END) as f:
            parts.append(f.read().strip() + "\n")
    path = os.path.join(root, "docs", "benchmarks.md")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    written.append(path)
    return written
