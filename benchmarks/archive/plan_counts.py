"""Estimated peaks of the default plan (`segments="auto"`) against the sqrt
plan, for the benchmark families at their benchmark sizes and a GPT-2-like
stack at real shapes. Plans only: nothing is trained or measured.

    python benchmarks/archive/plan_counts.py [--json PATH]
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above archive/
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.setrecursionlimit(10000)

import families  # noqa: E402
import graphckpt  # noqa: E402
from graphckpt.measure import format_bytes  # noqa: E402
from run_all import ACCEPTANCE, FAMILIES  # noqa: E402

GPT = dict(
    title="GPT-2-like stack: 12 blocks x 256, 4 heads, FFN 1024, tokens (None, None)",
    builder="text_transformer",
    kwargs=dict(dim=256, heads=4, ffn=1024, depth=12),
    input_shape=(8, 512),
)


def rows():
    """One row per family: segments, estimated peaks and planning time."""
    cases = dict(FAMILIES, acceptance=ACCEPTANCE, gpt_like=GPT)
    out = []
    for name, fam in cases.items():
        model = getattr(families, fam["builder"])(**fam["kwargs"])
        sizing = {"input_shape": fam["input_shape"]} if "input_shape" in fam else {"batch_size": fam["batch"]}
        row = {"family": name, "title": fam["title"], **{k: list(v) if isinstance(v, tuple) else v for k, v in sizing.items()}}
        for segments in ("auto", "sqrt"):
            t0 = time.perf_counter()
            p = graphckpt.plan(model, segments=segments, **sizing)
            row[segments] = {
                "segments": len(p.segments),
                "peak_bytes": p.estimated_peak_bytes,
                "plan_seconds": round(time.perf_counter() - t0, 2),
            }
            row["baseline_bytes"] = p.baseline_peak_bytes
        row["layer_calls"] = p.num_layer_calls
        if "input_shape" in fam:  # the same model estimated as Keras sees it: length 1
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row["unsized_baseline_bytes"] = graphckpt.plan(model, batch_size=fam["input_shape"][0]).baseline_peak_bytes
        out.append(row)
        a, s = row["auto"], row["sqrt"]
        print(
            f"{name:12s} {row['layer_calls']:4d} calls  baseline {format_bytes(row['baseline_bytes']):>10s}  "
            f"auto {a['segments']:3d} seg {format_bytes(a['peak_bytes']):>10s} ({a['plan_seconds']:.2f} s)  "
            f"sqrt {s['segments']:3d} seg {format_bytes(s['peak_bytes']):>10s} ({s['plan_seconds']:.2f} s)  "
            f"auto/sqrt x{a['peak_bytes'] / s['peak_bytes']:.2f}",
            flush=True,
        )
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the rows as JSON")
    args = p.parse_args()
    data = rows()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)


if __name__ == "__main__":
    main()
