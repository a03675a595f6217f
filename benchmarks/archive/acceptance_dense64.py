"""Issue 2's acceptance check, in one run: a 64-layer Dense(1024, tanh) chain
at batch 256 to 512; graphckpt's default plan must reach a peak
training-step memory at or below x0.35 of the baseline's, at a step time at
or below x1.40.

    .venv/bin/python benchmarks/archive/acceptance_dense64.py [--batch 512] [--repeats 5] [--jit] [--counter rss]

`--jit` compiles the train step with XLA (`jit_compile=True`; issue 14's
target there is x0.30); `--counter` picks the memory counter (`graphckpt.measure`).

Baseline and checkpointed model alternate, each run in a fresh process
(`graphckpt.measure.compare`); ratios are medians of the paired ratios.
Exit status 0 when both targets are met.
"""

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above archive/
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from graphckpt.measure import compare, format_bytes  # noqa: E402

PEAK_TARGET, TIME_TARGET = 0.35, 1.40


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--jit", action="store_true", help="jit_compile=True (XLA)")
    p.add_argument("--counter", default="auto", help="the memory counter: auto, rss or allocator")
    args = p.parse_args(argv)
    c = compare(
        os.path.join(HERE, "families.py") + ":dense_chain",
        batch_size=args.batch,
        builder_kwargs={"depth": 64, "width": 1024},
        repeats=args.repeats,
        steps=args.steps,
        warmup=2,
        jit_compile=args.jit,
        counter=args.counter,
    )
    base, ck = c.baseline, c.candidate
    cpu = statistics.median(k.step_cpu_s / b.step_cpu_s for b, k in zip(base, ck))
    xla = ", XLA" if args.jit else ""
    print(f"64 x Dense(1024, tanh), batch {args.batch}{xla}, {args.repeats} alternating runs each, {base[0].device}, "
          f"memory: {base[0].memory_method}")
    for name, ms in (("baseline", base), ("graphckpt", ck)):
        peaks = ", ".join(format_bytes(m.peak_bytes) for m in ms)
        times = ", ".join(f"{m.step_time_s:.2f}" for m in ms)
        print(f"  {name:9s} peak [{peaks}]  step s [{times}]  segments {ms[0].num_segments}")
    peak_ok, time_ok = c.peak_ratio <= PEAK_TARGET, c.time_ratio <= TIME_TARGET
    print(f"  peak ratio x{c.peak_ratio:.3f} (target <= x{PEAK_TARGET}): {'met' if peak_ok else 'MISSED'}")
    print(f"  time ratio x{c.time_ratio:.3f} (target <= x{TIME_TARGET}): {'met' if time_ok else 'MISSED'}"
          f"  [CPU-time ratio x{cpu:.3f}]")
    return 0 if peak_ok and time_ok else 1


if __name__ == "__main__":
    sys.exit(main())
