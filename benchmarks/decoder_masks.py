"""Where the LoRA line of issue 35 stands: keras_hub `TransformerDecoder`s
(the blocks of GPT2CausalLM: dim 256, 4 heads, FFN 1024, dropout 0.1) at
sequence 1280, batch 8, opened with `attention_chunks=8`, with and without
a padding mask, measured beside graphckpt's estimate.

TensorFlow CPU, BFC allocator: the peak of the second compiled training
step above the memory in use before it, one fresh process per row.

    PYTHONPATH=. .venv/bin/python benchmarks/decoder_masks.py [--seq 1280] [--depth 4]

With the padding mask, the measured peak is about twice the estimate;
without it, close. Not explained yet (benchmarks/notes.md, "Attention in
chunks").
"""

import argparse
import json
import os
import subprocess
import sys

BATCH = 8


def _row(seq, depth, padding, mode):
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import keras_hub
    import tensorflow as tf

    import graphckpt

    x = keras.Input((seq, 256))
    mask = keras.Input((seq,), dtype="int32")
    h = x
    for _ in range(depth):
        block = keras_hub.layers.TransformerDecoder(1024, 4, dropout=0.1, normalize_first=True)
        h = block(h, decoder_padding_mask=mask if padding else None)
    model = keras.Model([x, mask], h) if padding else keras.Model(x, h)
    shape = [(BATCH, seq, 256), (BATCH, seq)] if padding else (BATCH, seq, 256)
    kwargs = {"open_layers": True, "attention_chunks": 8} if mode == "chunks" else {}
    plan = graphckpt.plan(model, input_shape=shape, **kwargs)
    ck = graphckpt.checkpoint_model(model, input_shape=shape, **kwargs)
    xs = tf.random.normal((BATCH, seq, 256))
    xs = [xs, tf.ones((BATCH, seq), "int32")] if padding else xs
    weights = ck.trainable_variables

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(ck(xs, training=True) ** 2)
        return tape.gradient(loss, weights)

    step()
    tf.config.experimental.reset_memory_stats("CPU:0")
    start = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step()
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - start
    return {"padding_mask": padding, "plan": mode, "estimated_mib": round(plan.estimated_peak_bytes / 2**20, 1),
            "measured_mib": round(peak / 2**20, 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1280)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--row", nargs=2, metavar=("PADDING", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        print(json.dumps(_row(args.seq, args.depth, args.row[0] == "1", args.row[1])))
        return
    print("| padding mask | plan | estimated | measured |\n|---|---|---:|---:|")
    for padding in ("1", "0"):
        for mode in ("default", "chunks"):
            out = subprocess.run(
                [sys.executable, __file__, "--seq", str(args.seq), "--depth", str(args.depth), "--row", padding, mode],
                capture_output=True, text=True, check=True,
            ).stdout
            row = json.loads(out.strip().splitlines()[-1])
            plan = "open_layers, attention_chunks=8" if mode == "chunks" else "default"
            print(f"| {'yes' if row['padding_mask'] else 'no'} | {plan} | {row['estimated_mib']} MiB | "
                  f"{row['measured_mib']} MiB |", flush=True)


if __name__ == "__main__":
    main()
