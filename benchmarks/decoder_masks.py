"""Issue 35's LoRA line at the level of its blocks: keras_hub
`TransformerDecoder`s (GPT2CausalLM's: dim 256, 4 heads, FFN 1024,
dropout 0.1) at sequence 1280, batch 8, with and without a padding mask,
the default plan and `open_layers=True, attention_chunks=8`, measured
(`graphckpt.measure`: a fresh process per run, TensorFlow's allocator
peak over training steps) beside graphckpt's estimate.

    PYTHONPATH=. .venv/bin/python benchmarks/decoder_masks.py [--seq 1280] [--depth 4]

Each decoder makes its causal mask (batch x seq x seq) from no input at
all, and with a padding mask a batch x seq x seq int32 merge of the two:
ops TensorFlow's executor may run as soon as the step starts unless
something orders them (graphckpt.runtime.remat_tensorflow.tf_remat).
"""

import argparse
import pathlib
import warnings

from graphckpt.measure import measure

BATCH = 8
PLANS = {"default": {}, "open_layers, attention_chunks=8": {"open_layers": True, "attention_chunks": 8}}


def decoders(seq=1280, depth=4, padding=True):
    """`depth` keras_hub TransformerDecoders (pre-norm) on (seq, 256)
    features, with a padding-mask input when `padding`."""
    import keras
    import keras_hub

    inputs = {"x": keras.Input((seq, 256), name="x")}
    if padding:
        inputs["padding_mask"] = keras.Input((seq,), dtype="int32", name="padding_mask")
    h = inputs["x"]
    for _ in range(depth):
        block = keras_hub.layers.TransformerDecoder(1024, 4, dropout=0.1, normalize_first=True)
        h = block(h, decoder_padding_mask=inputs.get("padding_mask"))
    return keras.Model(inputs, h)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1280)
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    import graphckpt

    print("| padding mask | plan | estimated | measured |\n|---|---|---:|---:|")
    for padding in (True, False):
        config = dict(seq=args.seq, depth=args.depth, padding=padding)
        shape = {"x": (BATCH, args.seq, 256), **({"padding_mask": (BATCH, args.seq)} if padding else {})}
        model = decoders(**config)
        for name, kwargs in PLANS.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = graphckpt.plan(model, input_shape=shape, **kwargs)
            m = measure(f"{pathlib.Path(__file__).resolve()}:decoders", batch_size=BATCH, builder_kwargs=config,
                        method="graphckpt", checkpoint_kwargs=dict(kwargs, input_shape=shape), input_shape=shape,
                        label=name, steps=2, warmup=1, timeout=1800)
            print(f"| {'yes' if padding else 'no'} | {name} | {plan.estimated_peak_bytes / 2**20:.1f} MiB | "
                  f"{m.peak_bytes / 2**20:.1f} MiB |", flush=True)


if __name__ == "__main__":
    main()
