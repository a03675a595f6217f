"""Where the nested ResNet50V2's checkpointed peak exceeds its estimate:
the same model with the backbone's weights trainable and frozen
(BatchNormalization left trainable, so the activations are the same),
baseline and the default plan, measured (fresh process per run, TensorFlow
allocator statistics) beside graphckpt's estimate.

    PYTHONPATH=. .venv/bin/python benchmarks/nested_grads.py [--repeats 2]

Writes benchmarks/results/nested_grads.json.
"""

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from graphckpt.measure import measure  # noqa: E402

BATCH = 8


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    import families
    import graphckpt

    rows = []
    for frozen in (False, True):
        model = families.nested_resnet50v2(frozen_weights=frozen)
        e = graphckpt.estimate(model, graphckpt.plan(model, batch_size=BATCH), batch_size=BATCH)
        for method in ("baseline", "graphckpt"):
            peaks = []
            for _ in range(args.repeats):
                m = measure(os.path.join(HERE, "families.py") + ":nested_resnet50v2", batch_size=BATCH,
                            builder_kwargs={"frozen_weights": frozen}, method=method, steps=3, warmup=2)
                peaks.append(m.peak_bytes / 2**20)
            estimated = (e.baseline_peak_bytes if method == "baseline" else e.peak_bytes) / 2**20
            rows.append({"frozen_weights": frozen, "method": method, "estimated_mib": estimated, "measured_mib": peaks})
            print(f"{'frozen' if frozen else 'trainable':9s} {method:9s} estimated {estimated:6.1f} MiB, "
                  f"measured {', '.join(f'{x:.1f}' for x in peaks)} MiB", flush=True)
    with open(os.path.join(HERE, "results", "nested_grads.json"), "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "batch": BATCH, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
