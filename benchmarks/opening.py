"""Opening composite layers: peak training-step memory and step time
without checkpointing, with the default plan (composite layers one call)
and with `open_layers=True` (cuts inside them), on a model whose
transformer blocks are `keras.layers.Layer` subclasses (keras.io's,
`--family user_blocks`) and on keras_hub's ViT-Tiny backbone, whose blocks
all run in one `ViTEncoder` call (`--family vit_tiny`). Fresh process per
run, methods alternated, medians.

    PYTHONPATH=. .venv/bin/python benchmarks/opening.py --family vit_tiny [--rounds 3]
"""

import argparse
import json
import pathlib
import statistics

from graphckpt.measure import measure

FAMILIES = str(pathlib.Path(__file__).with_name("families.py"))
METHODS = {
    "baseline": dict(method="baseline"),
    "graphckpt (blocks whole)": dict(method="graphckpt"),
    "graphckpt open_layers": dict(method="graphckpt", checkpoint_kwargs={"open_layers": True}),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["user_blocks", "vit_tiny"], default="user_blocks")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    kwargs = {"seq_len": args.seq_len} if args.family == "user_blocks" else {}
    builder = f"{FAMILIES}:{args.family}"
    runs = {name: [] for name in METHODS}
    for _ in range(args.rounds):
        for name, method in METHODS.items():
            m = measure(builder, batch_size=args.batch_size, builder_kwargs=kwargs, label=name, **method)
            runs[name].append((m.peak_bytes, m.step_time_s))
    base_peak = statistics.median(p for p, _ in runs["baseline"])
    base_time = statistics.median(t for _, t in runs["baseline"])
    rows = []
    for name, values in runs.items():
        peak = statistics.median(p for p, _ in values)
        time = statistics.median(t for _, t in values)
        rows.append({"method": name, "peak_MiB": peak / 2**20, "peak_x": peak / base_peak, "time_x": time / base_time})
        print(f"{name:28s} peak {peak / 2**20:8.1f} MiB  x{peak / base_peak:.2f}   step time x{time / base_time:.2f}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
