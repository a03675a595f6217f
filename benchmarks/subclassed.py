"""Subclassed models through the fit flag: peak training-step memory and
step time of a GPT-style `keras.Model` subclass (tests/subclassed_models.py:
8 blocks written as `keras.layers.Layer` subclasses, `call` a Python loop
over them) at sequence 512, trained plainly and with its `call` traced and
routed through the checkpointed graph, as `fit(gradient_checkpointing=True)`
routes it. Fresh process per run, methods alternated, medians.

    PYTHONPATH=. .venv/bin/python benchmarks/subclassed.py [--rounds 3] [--seq-len 512]

`flagged` installs what a flagged `fit` installs for its duration (the
trace, the plan for the data's shapes, the instance `call` that routes
training through the twin) and leaves it on, so that the measuring child's
`train_on_batch` steps run the flag's code path.
"""

import argparse
import pathlib

from graphckpt.measure import measure

HERE = pathlib.Path(__file__)
MODELS = str(HERE.parent.parent / "tests" / "subclassed_models.py")
METHODS = {
    "baseline": dict(method="baseline"),
    "fit flag (traced)": dict(method=f"{HERE}:flagged"),
    "fit flag open_layers": dict(method=f"{HERE}:flagged", method_kwargs={"open_layers": True}),
    "fit flag budget=0.3": dict(method=f"{HERE}:flagged", method_kwargs={"budget": 0.3}),
}


def flagged(build, batch_size=8, seq_len=512, open_layers=False, budget=None):
    """The model `build()` returns, its training calls routed through the
    checkpointed graph of its traced `call`, as the fit flag routes them."""
    import keras

    from graphckpt.graph import tracing
    from graphckpt.training.flag import _training_call, _twin_for

    model = build()
    traced = tracing.trace_model(model, keras.KerasTensor((batch_size, seq_len), dtype="int32"))
    planner = {"input_shape": (batch_size, seq_len), "open_layers": open_layers or tracing.nested_models}
    if budget is not None:
        planner["budget"] = budget
    twin = _twin_for(model, planner, traced=traced)
    print(f"plan: {twin.plan}", flush=True)
    object.__setattr__(model, "call", _training_call(model, twin, traced))
    return model


def data(model, batch_size):
    """Token ids and next-token targets (as one-hot-sized float targets for
    `mse`: the loss's own memory is the same for both runs)."""
    import numpy as np

    rng = np.random.default_rng(0)
    seq_len = model.positions.embedding.input_dim
    vocab = model.head.units
    x = rng.integers(0, vocab, size=(batch_size, seq_len)).astype("int32")
    return x, rng.standard_normal(size=(batch_size, seq_len, vocab)).astype("float32")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated names of METHODS")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    methods = {name: METHODS[name] for name in args.methods.split(",")}
    from opening import alternate, summarize  # this script's folder is on the path

    def measure_one(name, method):
        method = dict(method)
        if method["method"] != "baseline":
            method["method_kwargs"] = dict(method.get("method_kwargs", {}), batch_size=args.batch_size,
                                           seq_len=args.seq_len)
        return measure(f"{MODELS}:gpt", batch_size=args.batch_size, builder_kwargs={"seq_len": args.seq_len},
                       data=f"{HERE}:data", label=name, **method)

    summarize(alternate(methods, args.rounds, measure_one), args)


if __name__ == "__main__":
    main()
