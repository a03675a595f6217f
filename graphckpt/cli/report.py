"""What `inspect`, `measure` and `demo` print: plain data about a plan
(`describe`), and the renderers (table, Graphviz, measured comparison)."""

import collections
import json
import re
import warnings

from graphckpt import errors
from graphckpt.graph.layer_graph import INPUT


def _tensor_name(key, names, graph):
    """A tensor by its producing call's name, with `[i]` when that call
    produces several tensors."""
    _, _, index = key
    producer = graph.tensors[key].producer
    n_out = sum(1 for info in graph.tensors.values() if info.producer == producer)
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
    from graphckpt.estimator.peak import estimate
    from graphckpt.graph.build import call_names

    names = call_names(graph)
    tensors = graph.tensors
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
    outside = [n[0] for n, d in graph.nodes(data=True) if d["kind"] == INPUT and n[0] not in seen]
    num_segments, num_recomputed = segment_counts(plan)
    return {
        "model": model.name,
        "num_layers": len(seen) + len(outside),
        "num_layer_calls": plan.num_layer_calls,
        "num_segments": num_segments,
        "num_recomputed": num_recomputed,
        "strategy": plan.strategy,
        "attention_chunks": plan.attention_chunks,
        "batch_size": memory.batch_size,
        "bytes_are": f"for a batch of {memory.batch_size}" if memory.batch_size else "per example",
        "segments": segments,
        "outside": outside,
        "kept_whole": dict(graph.kept_whole),
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
    from graphckpt.graph.build import call_names

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
        shapes = ", ".join(str(tuple(graph.tensors[t].shape)) for t in data["tensors"])
        lines.append(f"  {node_id(u)} -> {node_id(v)} [label={json.dumps(shapes)}, fontsize=8];")
    lines.append("}")
    return "\n".join(lines)


def make_console(stderr=False):
    """A console as wide as the terminal: `COLUMNS` if set, else the size
    of the terminal any standard stream is attached to (so `| less` still
    fits the screen), else 80 columns."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def _bytes(n):
    from graphckpt.measure import format_bytes

    return format_bytes(n)


def _shape(shape):
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ")"


def short_names(names):
    """Each of `names` (layer-call paths such as `backbone/block_3/conv`)
    by the shortest end of its path that no other name ends with: names
    relative to the model, still unambiguous.

    `Conv1` stands for `mobilenetv2_1.00_96/Conv1` when no other call's
    path ends in `Conv1`; `block/dense` and `block@1/dense` stay whole next
    to a top-level `dense`. A name's `#k` (its k-th call) stays with it.

    Returns:
        A dict: name -> its short form (distinct for distinct names).
    """
    names = set(names)
    ends = collections.Counter()
    for name in names:
        parts = name.split("/")
        ends.update("/".join(parts[i:]) for i in range(len(parts)))
    short = {}
    for name in names:
        parts = name.split("/")
        # From the last component outwards; a full name is always its own.
        short[name] = next(
            ("/".join(parts[i:]) for i in range(len(parts) - 1, 0, -1) if ends["/".join(parts[i:])] == 1), name
        )
    return short


_TENSOR_INDEX = re.compile(r"^(.*?)(\[[0-9]+\])?$")


def _namer(info, wide):
    """`(name_of, example)`: how the table writes a call or tensor name,
    and one `(short, full)` pair for the note that names were shortened
    (None when nothing was)."""
    if wide:
        return (lambda name: name), None
    calls = [c for seg in info["segments"] for c in seg["calls"]] + list(info["outside"])
    short = short_names(calls)

    def name_of(name):
        call, index = _TENSOR_INDEX.match(name).groups()
        return short.get(call, call) + (index or "")

    example = next(((short[c], c) for c in calls if short[c] != c), None)
    return name_of, example


def render_table(info, console, wide=False):
    """The plan as a table: one row per segment, in execution order.

    Names are relative to the model (`short_names`) unless `wide`; long
    ones wrap (a name is never cut), so the table fits `console.width`,
    80 columns included."""
    from rich.table import Table

    name_of, example = _namer(info, wide)
    segments = f"{plural(info['num_segments'], 'segment')}, {info['num_recomputed']} recomputed"
    title = (
        f"{info['model']}: {plural(info['num_layer_calls'], 'layer call')} in {segments} "
        f"({info['strategy']}, {_planned_for(info)})"
    )
    table = Table()
    table.add_column("seg", justify="right", no_wrap=True)
    table.add_column("calls", justify="right", overflow="fold")
    table.add_column("first, last call", overflow="fold")
    table.add_column("boundary tensors", overflow="fold")
    table.add_column("kept", justify="right", no_wrap=True)
    table.add_column("peak", justify="right", no_wrap=True)
    for seg in info["segments"]:
        index = str(seg["index"]) + ("" if seg["recomputed"] else "*")
        calls = str(seg["num_calls"])
        if seg["inner"]:  # cut again: inner segments' calls, `+`-separated
            calls += " = " + "+".join(f"{sub['num_calls']}" + ("" if sub["recomputed"] else "*") for sub in seg["inner"])
        span = name_of(seg["first"]) + ("" if seg["last"] == seg["first"] else "\n" + name_of(seg["last"]))
        # Each tensor's shape on a line of its own: a long name and its
        # shape wrap apart, not mid-shape.
        boundary = "\n".join(f"{name_of(b['tensor'])}\n{_shape(b['shape'])}" for b in seg["boundary"]) or "-"
        table.add_row(index, calls, span, boundary, _bytes(seg["kept_bytes"]), _bytes(seg["peak_bytes"]))
    if example is not None:
        short, full = example
        console.print(f"names relative to the model ({short}: {full}; --wide: full paths)")
    console.print(title)  # not the table's title: that wraps at the table's width
    console.print(table)
    totals = info["totals"]
    ratio = f" (x{totals['ratio']:.2f})" if totals["ratio"] is not None else ""
    console.print(
        f"estimated peak training-step memory ({info['bytes_are']}):\n"
        f"  baseline {_bytes(totals['baseline_bytes'])}, plan {_bytes(totals['plan_bytes'])}{ratio}"
    )
    console.print(f"recomputed in backward: {recompute_phrase(totals)}")
    console.print("kept: held from forward to the segment's backward; peak: estimated during it")
    if info["num_recomputed"] == 0:
        console.print(f"nothing recomputed: no cut lowers the estimated peak ({info['bytes_are']})")
    if not info["batch_size"]:
        # Per example, weight-sized buffers (which don't grow with the
        # batch) are left out: the best cuts at a real batch size differ.
        console.print("planned per example; at your batch size the plan may differ: pass --batch-size N")
    if totals["unknown_layers"]:
        console.print(f"estimated conservatively (unknown layers): {', '.join(totals['unknown_layers'])}")
    for name, why in info["kept_whole"].items():
        console.print(f"nested model '{name}' is one layer call, no cut inside it: {why}")
    if any(not s["recomputed"] for s in info["segments"]):
        console.print("* runs inline (not recomputed): its layer calls keep what they keep")
    if any(s["inner"] for s in info["segments"]):
        console.print(
            "a = b+c: a segment cut again (two levels): its recompute keeps only its inner segments' inputs, "
            "and each inner segment is recomputed once more (* kept: run as it is in that recompute)"
        )


def _planned_for(info):
    chunks = f", attention in {info['attention_chunks']} chunks" if info.get("attention_chunks") else ""
    return (f"batch {info['batch_size']}" if info["batch_size"] else "per example") + chunks


def recompute_phrase(totals):
    """What the plan recomputes, as a share of the forward pass. Its
    estimated time can pass one forward pass: each recomputed segment adds
    a call's overhead to the FLOPs it runs again."""
    flops = f"{totals['recompute_fraction']:.0%} of the forward FLOPs"
    time_ = totals["recompute_time_fraction"]
    if time_ <= 1:
        return f"{flops}, about {time_:.0%} of its time"
    return f"{flops}, about {time_:.2f}x its time"


def _spread(values, fmt):
    """`median (min-max)` of `values`, each written by `fmt`; one value alone."""
    import statistics

    median = fmt(statistics.median(values))
    if len(values) == 1:
        return median
    return f"{median} ({fmt(min(values))}-{fmt(max(values))})"


def _bytes_spread(values):
    """`13.8 MiB (13.7-14.7)`: the median's unit for the range too."""
    import statistics

    median = _bytes(int(statistics.median(values)))
    if len(values) == 1:
        return median
    number, unit = median.split(" ")
    scale = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}[unit]
    return f"{median} ({min(values) / scale:.1f}-{max(values) / scale:.1f})"


def render_comparison(comparison, console, plan=None):
    """Medians over the repeats, with their range, and the paired ratios.
    Step times on a shared machine are noisy: one pair of runs gives no
    time ratio, and several give it with their spread. With the `plan`
    measured, the segments column counts its segments as `inspect` does;
    the number recomputed is always the measured model's."""
    from rich.table import Table

    first = comparison.baseline[0]
    repeats = len(comparison.baseline)
    runs_ = f"; median (min-max) of {repeats} alternating runs" if repeats > 1 else ""
    title = f"measured: batch {first.batch_size}, {plural(first.steps, 'step')}, {first.device}{runs_}"
    table = Table()
    for col in ("model", "peak training-step memory", "step time", "segments"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for label, runs in (("baseline", comparison.baseline), ("graphckpt", comparison.candidate)):
        peak = _bytes_spread([m.peak_bytes for m in runs])
        step = _spread([m.step_time_s * 1000 for m in runs], lambda ms: f"{ms:.0f}")
        table.add_row(label, peak, f"{step} ms", _segments_cell(label, runs[0], plan))
    console.print(title)
    console.print(table)
    console.print(comparison_line(comparison))


def comparison_line(comparison):
    """graphckpt against the baseline: the peak memory ratio, and the time
    ratios with their spread over the pairs of runs (none from a single
    pair: one pair on a shared machine can read as a speed-up)."""

    def ratio(values):
        return _spread(values, lambda r: f"x{r:.2f}")

    peaks, times, cpus = (comparison.ratios(a) for a in ("peak_bytes", "step_time_s", "step_cpu_s"))
    peak = comparison.peak_ratio
    change = f"{abs(1 - peak) * 100:.0f}% {'less' if peak <= 1 else 'more'}"
    pairs = f", median (min-max) of {len(peaks)} pairs" if len(peaks) > 1 else ""
    lines = [f"graphckpt / baseline{pairs}:", f"  peak memory {ratio(peaks)}, {change}"]
    if len(times) < 2:
        lines.append("  step time not compared: one pair of runs is too noisy (--repeats 3 or more)")
    else:
        cpu = f"; CPU time {ratio(cpus)}" if len(cpus) == len(times) else ""
        lines.append(f"  step time {ratio(times)}{cpu}")
    return "\n".join(lines)


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
        warnings.warn(message, errors.GraphckptWarning, stacklevel=2)
