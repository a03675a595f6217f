"""The commands: `inspect`, `measure` and `demo`. Each takes the parsed
arguments and returns the exit status."""

import json
import os

from graphckpt.cli.args import CliError, planner_kwargs
from graphckpt.cli.loading import gist, load, planned
from graphckpt.cli.report import (
    describe,
    make_console,
    plural,
    render_comparison,
    render_table,
    segment_counts,
    segments_phrase,
    to_dot,
    warn_if_no_saving,
)
from graphckpt.cli.startup import import_keras

DEMO = {"depth": 36, "width": 256, "batch_size": 256}


def cmd_inspect(args):
    model = load(args.model, args.imports, args.debug)
    model, graph, the_plan = planned(model, planner_kwargs(args))
    warn_if_no_saving(the_plan, model.name)
    info = describe(model, graph, the_plan, args.batch_size)  # `graph` has the input shapes
    if args.format == "json":
        print(json.dumps(info, indent=2))
    elif args.format == "dot":
        print(to_dot(info, graph))
    else:
        render_table(info, make_console(), wide=args.wide)
    return 0


def measure_pair(builder, builder_kwargs, args, checkpoint_kwargs, input_shape=None):
    """Baseline and graphckpt, alternating, `args.repeats` times, each run
    in a fresh process, with a spinner, on random batches of `input_shape`
    (default: the model's input shapes). Returns a `Comparison`."""
    from graphckpt.measure import Comparison, measure

    console = make_console(stderr=True)
    runs = {"baseline": [], "graphckpt": []}
    total = 2 * args.repeats
    for i in range(total):
        method = ("baseline", "graphckpt")[i % 2]
        what = "the baseline" if method == "baseline" else "the checkpointed model"
        with console.status(f"measuring {what} in a fresh process ({i + 1}/{total})..."):
            m = measure(
                builder,
                batch_size=args.batch_size,
                method=method,
                builder_kwargs=builder_kwargs,
                checkpoint_kwargs=checkpoint_kwargs if method == "graphckpt" else None,
                input_shape=input_shape,
                steps=args.steps,
                check=False,
            )
        if not m.ok:
            raise CliError(f"measuring {what} failed (phase {m.phase}): {gist(m.error)}")
        runs[method].append(m)
    return Comparison(baseline=tuple(runs["baseline"]), candidate=tuple(runs["graphckpt"]))


def cmd_measure(args):
    import graphckpt

    model = load(args.model, args.imports, args.debug)
    if isinstance(model, graphckpt.CheckpointedModel):
        raise CliError(
            f"{args.model} is already checkpointed. Tip: measure the original model "
            "(`graphckpt.uncheckpoint(model).save(...)`)."
        )
    kwargs = planner_kwargs(args)
    the_plan = graphckpt.plan(model, **kwargs)  # bad arguments fail here, before any subprocess
    if the_plan.batch_size is None:
        raise CliError("measure needs a batch size: pass --batch-size N, or --input-shape with the batch first", code=2)
    warn_if_no_saving(the_plan, model.name)
    args.batch_size = the_plan.batch_size
    builder_kwargs = {"path": os.path.abspath(args.model), "imports": list(args.imports)}
    comparison = measure_pair(
        "graphckpt.cli.loading:load_model_file", builder_kwargs, args, kwargs, kwargs.get("input_shape")
    )
    render_comparison(comparison, make_console(), the_plan)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(comparison.to_dict(), f, indent=2)
    return 0


def demo_model(depth=DEMO["depth"], width=DEMO["width"]):
    """The demo's model: `depth` Dense(width, tanh) layers in a chain, then
    a Dense(1) head (`depth + 1` layers, and the input)."""
    keras = import_keras()

    inp = keras.Input((width,), name="x")
    x = inp
    for i in range(depth):
        x = keras.layers.Dense(width, activation="tanh", name=f"dense_{i}")(x)
    return keras.Model(inp, keras.layers.Dense(1, name="head")(x), name=f"dense_chain_{depth}x{width}")


def cmd_demo(args):
    import graphckpt
    from graphckpt.graph.build import build_graph

    import_keras()
    console = make_console()
    model = demo_model(args.depth, args.width)
    kwargs = planner_kwargs(args)
    the_plan = graphckpt.plan(model, **kwargs)
    if segment_counts(the_plan)[1] == 0:
        # Nothing to show: the checkpointed model would be the model itself.
        raise CliError(
            f"the demo's plan ({segments_phrase(the_plan)}) checkpoints nothing, so there is nothing to "
            "compare. Tip: run it on a deeper chain (the default is "
            f"--depth {DEMO['depth']}) or with --segments N.",
            code=2,
        )
    console.print(
        f"[bold]graphckpt demo[/bold]: {model.name}, a chain of {plural(args.depth, 'Dense layer')} "
        f"({args.width} units, tanh) and a Dense(1) head, batch {args.batch_size}.\n\n1. The plan "
        "(graphckpt.plan): a recomputed segment keeps its boundary tensors for backward and recomputes the rest."
    )
    warn_if_no_saving(the_plan, model.name)
    render_table(describe(model, build_graph(model), the_plan, args.batch_size), console)
    ck = graphckpt.checkpoint_model(model, **kwargs)
    segment_layers = sum(isinstance(layer, graphckpt.Segment) for layer in ck.layers)
    inline = segment_counts(the_plan)[0] - segment_layers
    inline = f"; {inline} {'runs' if inline == 1 else 'run'} inline" if inline > 0 else ""
    console.print(
        f"\n2. The rewrite (graphckpt.checkpoint_model): '{ck.name}', with "
        f"{plural(segment_layers, 'Segment layer')}, one per recomputed segment ({segments_phrase(the_plan)}"
        f"{inline}), and the same {len(model.weights)} weights.\n\n"
        "3. Measured peak training-step memory, each model trained in a fresh process:"
    )
    builder_kwargs = {"depth": args.depth, "width": args.width}
    render_comparison(measure_pair("graphckpt.cli.commands:demo_model", builder_kwargs, args, kwargs), console, the_plan)
    return 0
