"""keras_hub measurements for issue 12: a GPT-2 backbone at its real shapes,
a LoRA causal LM through the fit flag, and the longest sequence that fits a
memory budget.

Every figure comes from `graphckpt.measure` (a fresh process per run,
TensorFlow allocator statistics, the peak training step above the resident
state), baseline and graphckpt alternating round by round; ratios are
medians of the per-round ratios. Models are built from constructor
arguments with random init.

Usage:
    python benchmarks/hub.py backbone [--repeats 3]
    python benchmarks/hub.py lora [--repeats 3]
    python benchmarks/hub.py classifier [--repeats 3]   # BertTextClassifier, the same size, through the fit flag
    python benchmarks/hub.py longest [--budget-mib 1024] [--attention-chunks K] [--guess N]
    python benchmarks/hub.py exact            # fit flag vs plain fit, LoRA, dropout on
    python benchmarks/hub.py estimate         # the estimator against the saved backbone and lora runs
    python benchmarks/hub.py dropout --backend jax   # 4 and 8 blocks, dropout 0 and 0.1, seq 256

The causal LM's baseline is its layer graph as a plain functional model,
compiled as its checkpointed twin is (`measure` trains both with MSE on the
logits); the twin is what the fit flag runs in its place.

Writes benchmarks/results/hub_<what>.json.
"""

import argparse
import datetime
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from graphckpt.measure import format_bytes, measure  # noqa: E402

ME = os.path.abspath(__file__)
RESULTS = os.path.join(HERE, "results")

# The backbone: 12 blocks x 256, 4 heads, intermediate 1024.
BACKBONE = dict(num_layers=12, num_heads=4, hidden_dim=256, intermediate_dim=1024, dropout=0.1)
# The causal LM: the backbone above with a 1,000-token vocabulary. The
# logits (batch x seq x vocab) and their gradient are the same with or
# without checkpointing; a large vocabulary makes them the bulk of the peak
# (at 50,257 tokens, seq 512, batch 8: 823 MB each).
LM = dict(BACKBONE, vocabulary_size=1000)
# A BERT text classifier of the same size (`classifier`): its task takes the
# backbone's `pooled_output` only, beside which the backbone also returns
# `sequence_output`.
BERT = dict(BACKBONE, vocabulary_size=1000)
BERT_INPUTS = ("token_ids", "segment_ids", "padding_mask")


def gpt2_backbone(vocabulary_size=50257, max_sequence_length=1024, **kwargs):
    import keras_hub

    return keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary_size, max_sequence_length=max_sequence_length, **{**BACKBONE, **kwargs}
    )


def lora_causal_lm(max_sequence_length=4096, rank=4, **kwargs):
    """A GPT2CausalLM (no preprocessor) whose backbone has LoRA on."""
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(max_sequence_length=max_sequence_length, **{**LM, **kwargs})
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    lm.backbone.enable_lora(rank)
    return lm


def bert_classifier(max_sequence_length=512):
    import keras_hub

    backbone = keras_hub.models.BertBackbone(max_sequence_length=max_sequence_length, **BERT)
    return keras_hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None)


def fit_flag_twin(build, seq, names=("token_ids", "padding_mask"), **flag_kwargs):
    """What `fit(..., gradient_checkpointing=True, **flag_kwargs)` trains in
    place of `build()`'s forward pass: its checkpointed twin, planned for
    the data's shapes (`graphckpt.fit` builds the same one), over the same
    layers. `flag_kwargs`: `open_layers=True`, `attention_chunks=K`."""
    from graphckpt.training.flag import _twin_for

    model = build()
    twin = _twin_for(model, {"input_shape": _shape(8, seq, names), **flag_kwargs})
    return twin.model


def as_functional(build):
    """The task model's layer graph as a plain functional model (the same
    layers): compiled as the twin is, without the task's default metrics,
    which need integer labels."""
    import keras

    lm = build()
    return keras.Model(lm.input, lm.output, name=f"{lm.name}_plain")


def _shape(batch, seq, names=("token_ids", "padding_mask")):
    return {name: [batch, seq] for name in names}


def _ratio_rows(runs):
    base = [r for r in runs if r["label"] == "baseline"]
    ours = [r for r in runs if r["label"] != "baseline"]
    peaks = [o["peak_bytes"] / b["peak_bytes"] for b, o in zip(base, ours)]
    times = [o["step_time_s"] / b["step_time_s"] for b, o in zip(base, ours)]
    return {
        "peak_ratio": statistics.median(peaks),
        "time_ratio": statistics.median(times),
        "baseline_peak_bytes": statistics.median(r["peak_bytes"] for r in base),
        "graphckpt_peak_bytes": statistics.median(r["peak_bytes"] for r in ours),
        "num_segments": ours[0]["num_segments"],
    }


def _pair(builder, batch, shape, method_spec, repeats, baseline=None, steps=3):
    runs = []
    for rnd in range(repeats):
        for label, spec in (("baseline", baseline or dict(method="baseline")), ("graphckpt", method_spec)):
            m = measure(
                builder, batch_size=batch, input_shape=shape, label=label,
                steps=steps, warmup=2, timeout=1200, check=True, **spec,
            )
            d = m.to_dict()
            d["round"] = rnd
            runs.append(d)
            print(f"  round {rnd} {label}: peak {format_bytes(m.peak_bytes)}, step {m.step_time_s:.2f} s", flush=True)
    return runs


def run_backbone(args):
    shape = _shape(8, 512)
    spec = dict(method="graphckpt", checkpoint_kwargs={"input_shape": shape})
    runs = _pair(f"{ME}:gpt2_backbone", 8, shape, spec, args.repeats)
    return {"model": {"GPT2Backbone": BACKBONE, "vocabulary_size": 50257}, "batch": 8, "seq": 512, "runs": runs,
            "summary": _ratio_rows(runs), "target": {"peak": 0.20, "time": 1.40}}


def run_lora(args):
    shape = _shape(8, args.seq)
    spec = dict(method=f"{ME}:fit_flag_twin", method_kwargs={"seq": args.seq, **_flag_kwargs(args)})
    runs = _pair(f"{ME}:lora_causal_lm", 8, shape, spec, args.repeats, baseline=dict(method=f"{ME}:as_functional"))
    return {"model": {"GPT2CausalLM": LM, "lora_rank": 4}, "batch": 8, "seq": args.seq, "runs": runs,
            "summary": _ratio_rows(runs), "target": {"peak": 0.35}}


def run_classifier(args):
    shape = _shape(8, args.seq, BERT_INPUTS)
    spec = dict(method=f"{ME}:fit_flag_twin", method_kwargs={"seq": args.seq, "names": list(BERT_INPUTS)})
    runs = _pair(f"{ME}:bert_classifier", 8, shape, spec, args.repeats, baseline=dict(method=f"{ME}:as_functional"))
    return {"model": {"BertTextClassifier": BERT, "num_classes": 2}, "batch": 8, "seq": args.seq, "runs": runs,
            "summary": _ratio_rows(runs)}


def _flag_kwargs(args):
    """The fit flag's keywords from `--attention-chunks K` (attention calls
    opened out of the decoders, their cores in K chunks)."""
    return {"open_layers": True, "attention_chunks": args.attention_chunks} if args.attention_chunks else {}


def _longest(fits, guess=64):
    """The longest multiple of 64 for which `fits` holds (it holds up to
    some length and fails beyond): from `guess`, steps of 64 doubling each
    time, outward, until the answer changes, then bisection. A guess at the
    answer costs two measurements: it fits, 64 more does not."""
    if fits(guess):
        lo, step = guess, 64
        while fits(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step
    else:
        hi, step = guess, 64
        while hi - step > 0 and not fits(hi - step):
            hi, step = hi - step, step * 2
        lo = max(hi - step, 0)
    while hi - lo > 64:
        mid = (lo + hi) // 2 // 64 * 64
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def run_longest(args):
    """The longest sequence in the budget, for each method; graphckpt's
    search starts from `--guess`."""
    budget = args.budget_mib * 2**20
    found = {}
    for label, guess in (("baseline", 64), ("graphckpt", args.guess)):
        tried = {}

        def fits(seq, label=label, tried=tried):
            spec = dict(method=f"{ME}:as_functional") if label == "baseline" else dict(
                method=f"{ME}:fit_flag_twin", method_kwargs={"seq": seq, **_flag_kwargs(args)}
            )
            m = measure(f"{ME}:lora_causal_lm", batch_size=8, input_shape=_shape(8, seq), label=label, steps=2,
                        warmup=1, timeout=1800, check=False, **spec)
            ok = m.ok and m.peak_bytes <= budget
            tried[seq] = m.peak_bytes if m.ok else None
            print(f"  {label} seq {seq}: {format_bytes(m.peak_bytes) if m.ok else m.error} -> {'fits' if ok else 'no'}",
                  flush=True)
            return ok

        found[label] = {"longest": _longest(fits, guess), "tried": tried}
    ratio = found["graphckpt"]["longest"] / max(found["baseline"]["longest"], 1)
    return {"model": {"GPT2CausalLM": LM, "lora_rank": 4}, "batch": 8, "budget_bytes": budget, "methods": found,
            "summary": {"longest_ratio": ratio}, "target": {"longest_ratio": 5.0}}


def run_exact(args):
    """fit(gradient_checkpointing=True) vs plain fit of the LoRA LM, dropout
    on, the same seeds: loss history and every variable."""
    import keras
    import numpy as np

    import graphckpt

    def fit(flag):
        keras.utils.set_random_seed(0)
        lm = lora_causal_lm(max_sequence_length=256)
        lm.compile(optimizer=keras.optimizers.Adam(1e-3))
        rng = np.random.default_rng(0)
        x = {"token_ids": rng.integers(1, LM["vocabulary_size"], (16, 128)), "padding_mask": np.ones((16, 128), "int32")}
        y = rng.integers(1, LM["vocabulary_size"], (16, 128))
        keras.utils.set_random_seed(1)
        history = lm.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, gradient_checkpointing=flag)
        return history.history["loss"], [np.asarray(v) for v in lm.weights]

    graphckpt.install()
    (plain, w0), (flagged, w1) = fit(None), fit(True)
    worst = max(float(np.max(np.abs(a - b))) if a.size else 0.0 for a, b in zip(w0, w1))
    ok = np.allclose(flagged, plain, rtol=1e-4) and all(np.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(w1, w0))
    print(f"  plain {plain}\n  flag  {flagged}\n  largest weight difference {worst:.2e}: {'exact' if ok else 'DIFFERS'}")
    return {"plain_loss": plain, "flag_loss": flagged, "max_abs_weight_diff": worst, "exact": bool(ok)}


def run_estimate(args):
    """graphckpt's estimate of the baseline and the default plan, against the
    medians measured by the last `backbone` and `lora` runs (their JSON)."""
    import graphckpt

    shape = _shape(8, 512)
    rows = []
    for what, build in (("backbone", gpt2_backbone), ("lora", lambda: as_functional(lora_causal_lm))):
        with open(os.path.join(RESULTS, f"hub_{what}.json")) as f:
            measured = json.load(f)["summary"]
        model = build()
        e = graphckpt.estimate(model, graphckpt.plan(model, input_shape=shape), input_shape=shape)
        for plan, est, got in (("baseline", e.baseline_peak_bytes, measured["baseline_peak_bytes"]),
                               ("default", e.peak_bytes, measured["graphckpt_peak_bytes"])):
            rows.append({"model": what, "plan": plan, "estimated_bytes": est, "measured_bytes": got,
                         "error": est / got - 1})
            print(f"  {what:8s} {plan:8s} estimated {format_bytes(est)}, measured {format_bytes(got)}: "
                  f"{est / got - 1:+.0%}", flush=True)
    return {"batch": 8, "seq": 512, "rows": rows, "summary": {r["model"] + " " + r["plan"]: round(r["error"], 3)
                                                               for r in rows}}


def run_dropout(args):
    """The backbone with 4 and 8 blocks, dropout 0 and 0.1, at sequence 256
    (vocabulary 1,000), baseline and the default plan, on `--backend`: how
    much each block adds to the checkpointed peak with and without random
    masks (one run each)."""
    shape = _shape(8, 256)
    rows = []
    for label, spec in (("baseline", {}), ("graphckpt", {"checkpoint_kwargs": {"input_shape": shape}})):
        for dropout in (0.0, 0.1):
            for blocks in (4, 8):
                m = measure(f"{ME}:gpt2_backbone", batch_size=8, input_shape=shape, backend=args.backend, steps=2,
                            warmup=2, timeout=900, method=label, label=label,
                            builder_kwargs=dict(num_layers=blocks, dropout=dropout, vocabulary_size=1000), **spec)
                rows.append({"method": label, "dropout": dropout, "blocks": blocks, "peak_bytes": m.peak_bytes})
                print(f"  {label:9s} dropout {dropout} blocks {blocks}: {format_bytes(m.peak_bytes)}", flush=True)
    return {"backend": args.backend, "batch": 8, "seq": 256, "rows": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["backbone", "lora", "classifier", "longest", "exact", "estimate", "dropout"])
    parser.add_argument("--backend", default="jax", help="the Keras backend of `dropout`'s runs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--budget-mib", type=int, default=1024)
    parser.add_argument("--guess", type=int, default=64,
                        help="longest: where graphckpt's search starts (a multiple of 64)")
    parser.add_argument("--attention-chunks", type=int, default=None,
                        help="longest, lora: the fit flag with open_layers=True, attention_chunks=K")
    args = parser.parse_args()
    result = {"backbone": run_backbone, "lora": run_lora, "classifier": run_classifier, "longest": run_longest,
              "exact": run_exact,
              "estimate": run_estimate, "dropout": run_dropout}[args.what](args)
    result["date"] = datetime.date.today().isoformat()
    result["command"] = "python benchmarks/hub.py " + " ".join(sys.argv[1:])
    os.makedirs(RESULTS, exist_ok=True)
    name = f"hub_{args.what}" + (f"_{args.backend}" if args.what == "dropout" else "")
    name += f"_chunks{args.attention_chunks}" if args.attention_chunks else ""
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result["summary"] if "summary" in result else result, indent=1, default=str))


if __name__ == "__main__":
    main()
