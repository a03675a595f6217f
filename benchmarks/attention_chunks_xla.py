"""Attention in chunks on JAX: XLA's buffer assignment of the train step
(`memory_analysis().temp_size_in_bytes`, deterministic, this process) for
run_all.py's Transformer family at sequence 1024 (4 blocks, dim 64, 4
heads, FFN 256, batch 4), with and without dropout: the baseline, the
default plan (attention calls whole) and `attention_chunks=8`, beside
graphckpt's estimate.

    KERAS_BACKEND=jax PYTHONPATH=. .venv/bin/python benchmarks/attention_chunks_xla.py
"""

import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.getcwd())

import keras  # noqa: E402

import families  # noqa: E402
import graphckpt  # noqa: E402
from jax_estimate import _xla_temp  # noqa: E402

BATCH = 4


def main():
    if keras.backend.backend() != "jax":
        raise SystemExit("Run with KERAS_BACKEND=jax: the XLA figures are compiled in this process.")
    warnings.simplefilter("ignore")
    print("| dropout | plan | estimated | XLA temp |\n|---|---|---:|---:|")
    for rate in (0.1, 0.0):
        kwargs = dict(seq_len=1024, dim=64, heads=4, ffn=256, depth=4, rate=rate)
        for name, plan_kwargs in (("baseline", None), ("default", {}), ("attention_chunks=8", {"attention_chunks": 8})):
            model = families.transformer(**kwargs)
            if plan_kwargs is None:
                estimated = graphckpt.estimate(model, batch_size=BATCH).baseline_peak_bytes
            else:
                estimated = graphckpt.plan(model, batch_size=BATCH, **plan_kwargs).estimated_peak_bytes
                model = graphckpt.checkpoint_model(model, batch_size=BATCH, **plan_kwargs)
            temp = _xla_temp(model, BATCH)
            print(f"| {rate} | {name} | {estimated / 2**20:.1f} MiB | {temp / 2**20:.1f} MiB |", flush=True)


if __name__ == "__main__":
    main()
