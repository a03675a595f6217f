"""What `inspect`, `measure` and `demo` print: plain data about a plan
(`describe`), and the renderers (table, Graphviz, measured comparison)."""

import json
import warnings


def _tensor_name(key, names, graph):
    """A tensor by its producing call's name, with `[i]` when that call
    produces several tensors."""
    _, _, index = key
    producer = graph.graph["tensors"][key].producer
    n_out = sum(1 for info in graph.graph["tensors"].values() if info.producer == producer)
    return f"{names[producer]}[{index}]" if n_out > 1 else names[producer]


def plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def segment_counts(plan):
    """`(segments, recomputed)`: how many segments `plan` has, and how many
    of them are recomputed in backward (the rest run inline, as they are;
    the auto and sqrt plans run their last segment inline). A checkpointed
    model has one `Segment` layer per recomputed segment."""
    recomputed = sum(bool(getattr(seg, "remat", True)) for seg in plan.segments)
    return len(plan.segments), recomputed


def segments_phrase(plan):
    """`'4 segments, 3 recomputed'`: how every command counts segments."""
    total, recomputed = segment_counts(plan)
    return f"{plural(total, 'segment')}, {recomputed} recomputed"


def describe(model, graph, plan, batch_size=None):
    """Plain data about a plan: what `inspect` prints, and its JSON.

    Every layer of the model is named exactly once, by its path inside
    nested models (`resnet50v2/conv1_conv`; a nested model's second call
    is `name@1/...`): in `layers` of the first segment that calls it, or in
    `outside` (model inputs). `calls` lists each segment's layer calls; a
    path's k-th call (k > 0) is written `path#k`.
    """
    from graphckpt.estimate import estimate
    from graphckpt.graph import call_names

    names = call_names(graph)
    tensors = graph.graph["tensors"]
    memory = estimate(model, plan, batch_size=batch_size, graph=graph)
    batch = memory.batch_size or 1
    seen, segments = set(), []
    for seg, peak in zip(plan.segments, memory.segments):
        calls = [names[n] for n in seg.nodes]
        layers = [n[0] for n in seg.nodes if n[0] not in seen and not seen.add(n[0])]

        def boundary(keys):
            return [
                {
                    "tensor": _tensor_name(k, names, graph),
                    "shape": list(tensors[k].shape),
                    "dtype": tensors[k].dtype,
                    "bytes": tensors[k].nbytes * batch,
                }
                for k in keys
            ]

        segments.append(
            {
                "index": seg.index,
                "recomputed": bool(getattr(seg, "remat", True)),
                "first": calls[0],
                "last": calls[-1],
                "num_calls": len(calls),
                "calls": calls,
                # A segment cut again (two levels): its inner segments.
                "inner": [
                    {
                        "first": names[sub.nodes[0]],
                        "last": names[sub.nodes[-1]],
                        "num_calls": len(sub.nodes),
                        "recomputed": bool(sub.remat),
                    }
                    for sub in getattr(seg, "inner", ())
                ],
                "layers": layers,
                "inputs": boundary(seg.inputs),
                "boundary": boundary(seg.outputs),
                "kept_bytes": peak.held_bytes,
                "peak_bytes": peak.peak_bytes,
            }
        )
    outside = [n[0] for n, d in graph.nodes(data=True) if d["kind"] == "input" and n[0] not in seen]
    num_segments, num_recomputed = segment_counts(plan)
    return {
        "model": model.name,
        "num_layers": len(seen) + len(outside),
        "num_layer_calls": plan.num_layer_calls,
        "num_segments": num_segments,
        "num_recomputed": num_recomputed,
        "strategy": plan.strategy,
        "batch_size": memory.batch_size,
        "bytes_are": f"for a batch of {memory.batch_size}" if memory.batch_size else "per example",
        "segments": segments,
        "outside": outside,
        "kept_whole": dict(graph.graph.get("kept_whole") or {}),
        "totals": {
            "baseline_bytes": memory.baseline_peak_bytes,
            "plan_bytes": memory.peak_bytes,
            "ratio": memory.ratio,
            "recompute_fraction": memory.recompute_flops / memory.forward_flops if memory.forward_flops else 0.0,
            "recompute_time_fraction": (
                memory.recompute_seconds / memory.forward_seconds if memory.forward_seconds else 0.0
            ),
            "unknown_layers": list(memory.unknown_layers),
            "estimate": "graphckpt.estimate: peak training-step activation memory, from static shapes",
        },
    }


def to_dot(info, graph):
    """A Graphviz description: one node per layer call, segments as clusters."""
    from graphckpt.graph import call_names

    names = call_names(graph)

    def node_id(key):
        return json.dumps(names[key])

    lines = [f"digraph {json.dumps(info['model'])} {{", "  rankdir=TB;", "  node [shape=box, fontsize=10];"]
    for name in info["outside"]:
        lines.append(f"  {json.dumps(name)} [shape=ellipse];")
    for seg in info["segments"]:
        style = "rounded" if seg["recomputed"] else "dashed"
        label = f"segment {seg['index']}" + ("" if seg["recomputed"] else " (not recomputed)")
        lines.append(f"  subgraph cluster_{seg['index']} {{")
        lines.append(f"    label={json.dumps(label)}; style={style};")
        lines.extend(f"    {json.dumps(call)};" for call in seg["calls"])
        lines.append("  }")
    for u, v, data in graph.edges(data=True):
        shapes = ", ".join(str(tuple(graph.graph["tensors"][t].shape)) for t in data["tensors"])
        lines.append(f"  {node_id(u)} -> {node_id(v)} [label={json.dumps(shapes)}, fontsize=8];")
    lines.append("}")
    return "\n".join(lines)


def make_console(stderr=False):
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:  # piped or captured: no 80-column default
        console = Console(stderr=stderr, highlight=False, width=120)
    return console


def _bytes(n):
    from graphckpt.measure import format_bytes

    return format_bytes(n)


def _shape(shape):
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ")"


def render_table(info, console):
    from rich.table import Table

    segments = f"{plural(info['num_segments'], 'segment')}, {info['num_recomputed']} recomputed"
    title = f"{info['model']}: {plural(info['num_layer_calls'], 'layer call')} in {segments} ({info['strategy']})"
    table = Table(title=title, title_justify="left")
    for col, justify in [("seg", "right"), ("first", "left"), ("last", "left"), ("calls", "right")]:
        table.add_column(col, justify=justify)
    table.add_column("boundary tensors", justify="left")
    table.add_column("kept bytes", justify="right")
    table.add_column("peak in its backward", justify="right")
    for seg in info["segments"]:
        boundary = "\n".join(f"{b['tensor']} {_shape(b['shape'])}" for b in seg["boundary"]) or "-"
        index = str(seg["index"]) + ("" if seg["recomputed"] else "*")
        calls = str(seg["num_calls"])
        if seg["inner"]:  # cut again: inner segments' calls, `+`-separated
            calls += " = " + "+".join(f"{sub['num_calls']}" + ("" if sub["recomputed"] else "*") for sub in seg["inner"])
        row = (seg["first"], seg["last"], calls, boundary)
        table.add_row(index, *row, _bytes(seg["kept_bytes"]), _bytes(seg["peak_bytes"]))
    console.print(table)
    totals = info["totals"]
    ratio = f" (x{totals['ratio']:.2f})" if totals["ratio"] is not None else ""
    console.print(
        f"estimated peak training-step memory ({info['bytes_are']}): "
        f"baseline {_bytes(totals['baseline_bytes'])}, plan {_bytes(totals['plan_bytes'])}{ratio}"
    )
    console.print(
        f"recomputed in backward: {totals['recompute_fraction']:.0%} of the forward FLOPs, "
        f"about {totals['recompute_time_fraction']:.0%} of its time"
    )
    if totals["unknown_layers"]:
        console.print(f"estimated conservatively (unknown layers): {', '.join(totals['unknown_layers'])}")
    for name, why in info["kept_whole"].items():
        console.print(f"nested model '{name}' is one layer call, no cut inside it: {why}")
    if any(not s["recomputed"] for s in info["segments"]):
        console.print("* runs inline, not recomputed: its layer calls run as they are and keep what they keep")
    if any(s["inner"] for s in info["segments"]):
        console.print(
            "a = b+c: a segment cut again (two levels): its recompute keeps only its inner segments' inputs, "
            "and each inner segment is recomputed once more (* kept: run as it is in that recompute)"
        )


def render_comparison(comparison, console, plan=None):
    """Medians over the repeats, and the median paired ratios. With the
    `plan` measured, the segments column counts its segments as `inspect`
    does; the number recomputed is always the measured model's."""
    import statistics

    from rich.table import Table

    first = comparison.baseline[0]
    repeats = len(comparison.baseline)
    title = f"measured: batch {first.batch_size}, {plural(first.steps, 'step')}" + (f" x {repeats} runs" if repeats > 1 else "")
    table = Table(title=f"{title}, {first.device}", title_justify="left")
    for col in ("model", "peak training-step memory", "step time", "segments"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for label, runs in (("baseline", comparison.baseline), ("graphckpt", comparison.candidate)):
        peak = statistics.median(m.peak_bytes for m in runs)
        step = statistics.median(m.step_time_s for m in runs)
        table.add_row(label, _bytes(int(peak)), f"{step * 1000:.1f} ms", _segments_cell(label, runs[0], plan))
    console.print(table)
    peak, time_ = comparison.peak_ratio, comparison.time_ratio
    change = f"{abs(1 - peak) * 100:.0f}% {'less' if peak <= 1 else 'more'}"
    console.print(f"graphckpt / baseline: peak memory x{peak:.2f} ({change}), step time x{time_:.2f}")
    if repeats == 1:
        console.print("(one run each; step times on a busy machine are noisy: --repeats N alternates N pairs)")


def _segments_cell(label, measurement, plan):
    if label == "baseline":
        return "-"
    recomputed = measurement.num_segments or 0  # the measured model's Segment layers
    if plan is None:
        return f"{recomputed} recomputed"
    return f"{segment_counts(plan)[0]}, {recomputed} recomputed"


def plan_warning(plan, model_name):
    """Why `plan`, which recomputes, saves no memory by its own estimate, or None.

    A recomputed segment keeps its inputs and holds its whole interior
    again in its backward: a plan with few or short segments can need more
    memory than no plan at all.
    """
    _, recomputed = segment_counts(plan)
    peak, baseline = plan.estimated_peak_bytes, plan.baseline_peak_bytes
    if peak is None or baseline is None:
        return None
    if recomputed == 0:  # no checkpointing, no extra memory; the table says "0 recomputed"
        return None
    if peak >= baseline:
        change = "raises" if peak > baseline else "does not lower"
        more = f" ({peak - baseline:+,} bytes)" if _bytes(peak) == _bytes(baseline) and peak != baseline else ""
        return (
            f"the plan for model '{model_name}' ({segments_phrase(plan)}) {change} the estimated peak: "
            f"{_bytes(peak)}{more}, against {_bytes(baseline)} without checkpointing. A recomputed segment keeps "
            "its inputs and holds its interior again in its backward, so too few or too short segments cost "
            "memory. Tip: use the default, --segments auto, or a --budget."
        )
    return None


def warn_if_no_saving(plan, model_name):
    message = plan_warning(plan, model_name)
    if message:
        warnings.warn(message, stacklevel=2)
