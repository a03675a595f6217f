"""Opening composite layers: peak training-step memory and step time
without checkpointing, with the default plan (composite layers one call)
and with `open_layers=True` (cuts inside them), on a model whose
transformer blocks are `keras.layers.Layer` subclasses (keras.io's,
`--family user_blocks`) and on keras_hub's ViT-Tiny backbone, whose blocks
all run in one `ViTEncoder` call (`--family vit_tiny`). Fresh process per
run, methods alternated, medians.

    PYTHONPATH=. .venv/bin/python benchmarks/opening.py --family vit_tiny [--rounds 3]

`--family mha_1024 --batch-size 4`: run_all.py's Transformer family with 4
blocks of Keras's MultiHeadAttention at sequence 1024, dim 64, 4 heads
(`--rate 0` drops its dropout, attention's included).

`--family gpt2`: keras_hub's GPT2Backbone 12 x 256 at sequence 512, batch 8
(benchmarks/hub.py's), whose decoders open only at the planned shapes. It
adds budget plans with open layers, at the default plan's estimated peak x
1.05 and at 0.45 of the estimated baseline (the planner picks what to keep
inside the blocks), and the named policy `save_projections` (Megatron's
selective recompute: projections kept, attention core recomputed).

`--chunks K` adds two methods: `attention_chunks=K` (each
MultiHeadAttention call's core in K chunks of its (example, head) pairs, each recomputed:
graphckpt.runtime.attention), and the same with `open_layers=True` (a
user's block opens; its attention stays whole, in chunks); on `--family
gpt2` a third, with `budget=0.45` (the planner picks what to keep inside
the blocks; the attention core is recomputed in its pieces). `--only chunks` runs only the
methods whose names contain "chunks" (and the baseline).
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


HUB = str(pathlib.Path(__file__).with_name("hub.py"))


def _gpt2_methods(shape):
    """The methods for `--family gpt2`, budgets from the estimates."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import warnings

    import graphckpt
    import hub

    model = hub.gpt2_backbone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = graphckpt.plan(model, input_shape=shape)
    opened = dict(open_layers=True, input_shape=shape)
    return {
        "baseline": dict(method="baseline"),
        "graphckpt (blocks whole)": dict(method="graphckpt", checkpoint_kwargs={"input_shape": shape}),
        "graphckpt open_layers": dict(method="graphckpt", checkpoint_kwargs=opened),
        "open, budget default x1.05": dict(
            method="graphckpt", checkpoint_kwargs=dict(opened, budget=int(default.estimated_peak_bytes * 1.05))
        ),
        "open, budget x0.45": dict(
            method="graphckpt", checkpoint_kwargs=dict(opened, budget=int(default.baseline_peak_bytes * 0.45))
        ),
        "open, save_projections": dict(method="graphckpt", checkpoint_kwargs=dict(opened, policy="save_projections")),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["user_blocks", "vit_tiny", "gpt2", "mha_1024"], default="user_blocks")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=None, help="add plans with attention_chunks=K")
    parser.add_argument("--rate", type=float, default=0.1, help="mha_1024: the dropout rate (attention's too)")
    parser.add_argument("--only", default=None, help="comma-separated parts of method names to run (and the baseline)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    kwargs = {"seq_len": args.seq_len} if args.family == "user_blocks" else {}
    builder, methods, extra = f"{FAMILIES}:{args.family}", METHODS, {}
    if args.family == "mha_1024":  # 4 MultiHeadAttention blocks at sequence 1024 (pass --batch-size 4)
        builder, kwargs = f"{FAMILIES}:transformer", dict(seq_len=1024, dim=64, heads=4, ffn=256, depth=4, rate=args.rate)
    if args.family == "gpt2":
        shape = {"token_ids": (args.batch_size, args.seq_len), "padding_mask": (args.batch_size, args.seq_len)}
        builder, methods, extra = f"{HUB}:gpt2_backbone", _gpt2_methods(shape), {"input_shape": shape, "timeout": 1800}
    if args.chunks:
        methods = dict(methods)
        common = dict(methods["graphckpt (blocks whole)"].get("checkpoint_kwargs", {}), attention_chunks=args.chunks)
        methods[f"attention_chunks={args.chunks}"] = dict(method="graphckpt", checkpoint_kwargs=common)
        methods[f"open, attention_chunks={args.chunks}"] = dict(
            method="graphckpt", checkpoint_kwargs=dict(common, open_layers=True)
        )
        if args.family == "gpt2":  # what to keep inside the blocks, the scores never kept
            methods[f"open, budget x0.45, chunks={args.chunks}"] = dict(
                method="graphckpt", checkpoint_kwargs=dict(common, open_layers=True, budget=0.45)
            )
    if args.only:
        methods = {name: m for name, m in methods.items() if name == "baseline" or any(
            part in name for part in args.only.split(","))}
    runs = alternate(
        methods,
        args.rounds,
        lambda name, method: measure(builder, batch_size=args.batch_size, builder_kwargs=kwargs, label=name, **extra,
                                     **method),
    )
    summarize(runs, args)


def alternate(methods, rounds, measure_one):
    """`{name: [(peak bytes, step time, CPU time), ...]}`: `rounds` rounds of
    `measure_one(name, method)` over `methods` in turn (a fresh process
    each), failures printed and left out."""
    runs = {name: [] for name in methods}
    for _ in range(rounds):
        for name, method in methods.items():
            m = measure_one(name, method)
            if not m.ok:
                print(f"{name}: FAILED {m.error[:300]}", flush=True)
                continue
            print(f"  {name:28s} peak {m.peak_bytes / 2**20:8.1f} MiB  step {m.step_time_s:.2f} s  cpu {m.step_cpu_s:.2f} s",
                  flush=True)
            runs[name].append((m.peak_bytes, m.step_time_s, m.step_cpu_s))
    return runs


def summarize(runs, args):
    """Prints each method's medians as ratios to the baseline's, and writes
    them as JSON to `args.out` if given."""
    base_peak, base_time, base_cpu = (statistics.median(r[i] for r in runs["baseline"]) for i in range(3))
    rows = []
    for name, values in runs.items():
        if not values:
            continue
        peak, time, cpu = (statistics.median(r[i] for r in values) for i in range(3))
        rows.append({"method": name, "peak_MiB": peak / 2**20, "peak_x": peak / base_peak, "time_x": time / base_time,
                     "cpu_x": cpu / base_cpu, "rounds": len(values)})
        print(f"{name:28s} peak {peak / 2**20:8.1f} MiB  x{peak / base_peak:.3f}   step time x{time / base_time:.2f}"
              f"   CPU x{cpu / base_cpu:.2f}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
