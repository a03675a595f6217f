"""Memory-budget planning: the DP against brute force on literal graphs, the
budget contract, budget parsing, the public API, and exactness end to end."""

import itertools
import math
import os
import random
import subprocess
import sys
import warnings

import keras
import networkx as nx
import pytest
from keras import layers

import graphckpt
from graphckpt.budget import parse_budget
from graphckpt.graph.build import TensorInfo, build_graph
from graphckpt.planner import (
    BudgetInfeasible,
    NodeCosts,
    plan_for_budget,
    plan_from_boundaries,
    segment_peaks,
    smallest_peak,
    topological_order,
    validate_plan,
)
from graphckpt.runtime.segment import Segment
from tests import models
from tests.helpers import compare_step
from tests.planner.graphs import dag

MODES = pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])


# ------------------------------------------------------------ literal graphs


def random_dag(rng, n):
    """A random DAG in graph/layer_graph.py's schema: node "x" is the model input, nodes
    n0..n{n-1} are layer calls, each making one tensor; a call reads 1-2
    earlier tensors. The last call is the model output, plus sometimes one
    more."""
    g, _ = dag(
        n,
        lambda i, earlier: {rng.choice(earlier)} if rng.random() < 0.5 else set(),
        lambda names: rng.choice(names[:-1]) if n > 2 and rng.random() < 0.3 else None,
    )
    return g


def random_costs(rng, g):
    calls = [v for v, d in g.nodes(data=True) if d["kind"] != "input"]
    tensor_bytes = {k: rng.randint(1, 40) for k in g.graph["tensors"]}
    return NodeCosts(
        tensor_bytes=tensor_bytes,
        saved=frozenset(k for k in tensor_bytes if rng.random() < 0.7),
        internal={v: rng.choice([0, 0, rng.randint(1, 30)]) for v in calls},
        workspace={v: rng.randint(0, 20) for v in calls},
        compute={v: float(rng.randint(1, 50)) for v in calls},
        fixed=rng.randint(0, 10),
        prunable=frozenset(v for v in calls if rng.random() < 0.3),
    )


def reference_peak(g, order, segments, costs):
    """The memory model of `graphckpt.plan` (see `_Spans`), written out
    naively from sets, for one plan: `segments` is [(a, b, remat), ...]."""
    pos = {v: i for i, v in enumerate(order)}
    tensors = g.graph["tensors"]
    consumers = {}
    for _, v, d in g.edges(data=True):
        for t in d["tensors"]:
            consumers.setdefault(t, set()).add(v)
    outputs = set(g.graph["outputs"])

    def kept(v):
        made = [k for k, info in tensors.items() if info.producer == v]
        return costs.internal[v] + sum(costs.tensor_bytes[k] for k in made if k in costs.saved)

    held_before, peak = 0, 0
    for a, b, remat in segments:
        inside = set(order[a:b])
        out = [
            k
            for k, info in tensors.items()
            if info.producer in inside and (k in outputs or any(pos[c] >= b for c in consumers.get(k, ())))
        ]
        ins = [
            k
            for k, info in tensors.items()
            if info.producer not in inside
            and (info.producer not in pos or pos[info.producer] < a)
            and any(c in inside for c in consumers.get(k, ()))
        ]
        out_bytes = sum(costs.tensor_bytes[k] for k in out)
        running, worst = 0, 0
        for v in order[a:b]:
            running += kept(v)
            worst = max(worst, running + costs.workspace[v])
        inner = worst + out_bytes + (sum(costs.tensor_bytes[k] for k in ins) if remat else 0)
        peak = max(peak, costs.fixed + held_before + inner)
        if remat:
            held_before += out_bytes
        else:
            held_before += running + sum(costs.tensor_bytes[k] for k in out if k not in costs.saved)
    return peak


def all_plans(n, keep_positions=()):
    """Every plan the planner may choose: each cut set, each remat flag per
    segment, no two kept segments adjacent, no kept call recomputed."""
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        spans = list(zip(bounds, bounds[1:]))
        for flags in itertools.product([True, False], repeat=len(spans)):
            if any(not x and not y for x, y in zip(flags, flags[1:])):
                continue
            if any(r and any(a <= p < b for p in keep_positions) for (a, b), r in zip(spans, flags)):
                continue
            yield [(a, b, r) for (a, b), r in zip(spans, flags)]


def recompute_cost(order, segments, costs, g):
    """Each recomputed segment's calls, less the dead ones: prunable calls
    that no call of the segment reads, or only dead ones do."""
    total = 0.0
    for a, b, r in segments:
        inside, dead = set(order[a:b]), set()
        for v in reversed(order[a:b]):
            if v in costs.prunable and all(w in dead for w in g.successors(v) if w in inside):
                dead.add(v)
        total += sum(costs.compute[v] for v in order[a:b] if r and v not in dead)
    return total


@pytest.mark.parametrize("seed", range(12))
def test_dp_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    g = random_dag(rng, rng.randint(3, 7))
    costs = random_costs(rng, g)
    order = topological_order(g)
    keep = {v for v in order if rng.random() < 0.2}
    keep_pos = [i for i, v in enumerate(order) if v in keep]
    plans = list(all_plans(len(order), keep_pos))
    peaks = [reference_peak(g, order, p, costs) for p in plans]
    assert smallest_peak(g, costs, keep=keep) == min(peaks)
    for budget in sorted({rng.randint(min(peaks), max(peaks)) for _ in range(4)} | {min(peaks)}):
        best = min(recompute_cost(order, p, costs, g) for p, pk in zip(plans, peaks) if pk <= budget)
        plan = plan_for_budget(g, costs, budget, keep=keep)
        validate_plan(g, plan)
        chosen = [(a, b, s.remat) for s, a, b in zip(plan.segments, plan.boundaries, plan.boundaries[1:])]
        assert plan.estimated_peak_bytes == reference_peak(g, order, chosen, costs) <= budget
        assert recompute_cost(order, chosen, costs, g) == pytest.approx(best)
        assert not any(s.remat and keep & set(s.nodes) for s in plan.segments)


def test_budget_is_respected_by_the_estimate_and_tighter_budgets_recompute_more():
    rng = random.Random(7)
    g = random_dag(rng, 40)
    costs = random_costs(rng, g)
    low = smallest_peak(g, costs)
    high = plan_for_budget(g, costs, 10**9).baseline_peak_bytes
    last_cost = -1.0
    for budget in reversed(range(low, high + 1, max(1, (high - low) // 12))):
        plan = plan_for_budget(g, costs, budget)
        peaks = segment_peaks(g, plan, costs)
        assert plan.estimated_peak_bytes == max(p.peak_bytes for p in peaks) <= budget
        cost = sum(p.recompute_cost for p in peaks)
        assert cost >= last_cost  # less memory never costs less recompute
        last_cost = cost


def test_infeasible_budget_names_the_smallest_estimate():
    rng = random.Random(3)
    g = random_dag(rng, 12)
    costs = random_costs(rng, g)
    smallest = smallest_peak(g, costs)
    with pytest.raises(BudgetInfeasible, match=f"smallest estimated peak is {smallest} bytes") as info:
        plan_for_budget(g, costs, smallest - 1, two_level=False)
    assert info.value.smallest_bytes == smallest
    assert plan_for_budget(g, costs, smallest).estimated_peak_bytes <= smallest


def test_a_chain_plan_keeps_boundaries_and_recomputes_interiors():
    """A hand-checked case: 6 calls of 10-byte tensors, each kept by its
    consumer. Baseline peak = 6 x 10 kept + 10 (output gradient) + workspace."""
    g = nx.DiGraph()
    names = ["x"] + [f"n{i}" for i in range(6)]
    for i, v in enumerate(names):
        g.add_node(v, kind="input" if i == 0 else "layer", position=i)
    for u, v in zip(names, names[1:]):
        g.add_edge(u, v, tensors=((u, 0, 0),))
    g.graph["tensors"] = {(v, 0, 0): TensorInfo((v, 0, 0), v, (None,), "float32", 10) for v in names}
    g.graph["inputs"], g.graph["outputs"] = [("x", 0, 0)], [("n5", 0, 0)]
    calls = names[1:]
    costs = NodeCosts(
        tensor_bytes={k: 10 for k in g.graph["tensors"]},
        saved=frozenset((v, 0, 0) for v in names[:-1]),  # each consumer keeps its input
        internal={v: 0 for v in calls},
        workspace={v: 0 for v in calls},
        compute={v: 1.0 for v in calls},
    )
    order = topological_order(g)
    base = plan_from_boundaries(g, order, [0], remat=[False])
    assert segment_peaks(g, base, costs)[0].peak_bytes == 50 + 10  # n0..n4 kept, output gradient
    two = plan_from_boundaries(g, order, [0, 3])
    first, second = segment_peaks(g, two, costs)
    assert first.held_bytes == 10  # n2 crosses the cut
    assert second.held_before_bytes == 10
    # recompute of n3..n5: keeps n3, n4; output gradient 10; input copy n2 10
    assert second.recompute_peak_bytes == 20 + 10 + 10
    assert plan_for_budget(g, costs, 60).segments[0].remat is False  # fits as is: no recompute


# ------------------------------------------------------------ purity


def test_the_planner_never_imports_keras():
    path = os.path.join(os.path.dirname(graphckpt.__file__), "planner", "__init__.py")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('standalone_plan', {path!r})\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(mod)\n"
        "assert hasattr(mod, 'plan_for_budget')\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('keras', 'tensorflow', 'jax', 'torch'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------ budget parsing

GOOD = [
    (1000, ("bytes", 1000)),
    ("512MiB", ("bytes", 512 * 2**20)),
    ("2GiB", ("bytes", 2 * 2**30)),
    ("2GB", ("bytes", 2 * 10**9)),
    ("1.5 GB", ("bytes", 1_500_000_000)),
    ("1.5gib", ("bytes", int(1.5 * 2**30))),
    ("800 KB", ("bytes", 800_000)),
    ("4096", ("bytes", 4096)),
    ("100 B", ("bytes", 100)),
    (0.3, ("fraction", 0.3)),
    (0.999, ("fraction", 0.999)),
]
BAD = ["12 parsecs", -1, 0, True, False, None, 1.0, 1.5, 0.0, -0.2, float("nan"), "", "GB", "-2GB", "0MiB", "2 GiB!", [1], "1e9"]


@pytest.mark.parametrize("budget, expected", GOOD, ids=[repr(g[0]) for g in GOOD])
def test_budget_parsing(budget, expected):
    assert parse_budget(budget) == expected


@pytest.mark.parametrize("budget", BAD, ids=repr)
def test_bad_budgets_list_the_accepted_forms(budget):
    with pytest.raises(graphckpt.InvalidArgumentError, match=r"Accepted: an int number of bytes.*'512MiB'.*\(0, 1\)"):
        parse_budget(budget)


# ------------------------------------------------------------ public API


def transformer_block(seq=8, dim=16, depth=2):
    inp = keras.Input((seq, dim))
    x = layers.Dense(dim)(inp)
    for _ in range(depth):
        h = layers.LayerNormalization()(x)
        h = layers.MultiHeadAttention(2, dim // 2, dropout=0.2)(h, h)
        x = layers.Add()([x, layers.Dropout(0.2)(h)])
        h = layers.LayerNormalization()(x)
        h = layers.Dense(2 * dim)(h)
        h = layers.Activation("gelu")(h)
        h = layers.Dropout(0.3)(h)
        h = layers.Dense(dim)(h)
        x = layers.Add()([x, h])
    return keras.Model(inp, layers.Dense(2)(layers.GlobalAveragePooling1D()(x)), name="transformer_block")


def test_plan_carries_estimates_and_the_budget():
    model = models.chain(depth=16, width=32, dropout=0.3, bn=True)
    default = graphckpt.plan(model, batch_size=64)
    assert default.batch_size == 64 and default.estimated_peak_bytes < default.baseline_peak_bytes
    budget = (default.estimated_peak_bytes + default.baseline_peak_bytes) // 2
    p = graphckpt.plan(model, budget=budget, batch_size=64)
    assert p.strategy == "budget" and p.budget_bytes == budget
    assert p.estimated_peak_bytes <= budget and p.baseline_peak_bytes == default.baseline_peak_bytes
    assert any(not s.remat for s in p.segments) and any(s.remat for s in p.segments)
    frac = graphckpt.plan(model, budget=0.6, batch_size=64)
    assert frac.budget_bytes == int(0.6 * frac.baseline_peak_bytes)
    per_example = graphckpt.plan(model)
    assert per_example.batch_size is None and 0 < per_example.estimated_peak_bytes < default.estimated_peak_bytes


def test_budget_at_or_above_the_baseline_returns_the_model_unchanged():
    model = models.chain(depth=8, width=16)
    base = graphckpt.plan(model, batch_size=8).baseline_peak_bytes
    with pytest.warns(UserWarning, match="at or above the estimated peak of the model without checkpointing"):
        assert graphckpt.checkpoint_model(model, budget=base, batch_size=8) is model
    with pytest.warns(UserWarning, match="checkpoints nothing"):
        p = graphckpt.plan(model, budget=f"{base * 2} B", batch_size=8)
    assert [s.remat for s in p.segments] == [False]


def test_infeasible_budget_through_the_api():
    model = models.resnet()
    with pytest.raises(graphckpt.InfeasibleBudgetError, match=r"smallest achievable estimated peak is [\d.]+ KiB"):
        graphckpt.checkpoint_model(model, budget="1KiB", batch_size=4)
    with pytest.raises(graphckpt.InfeasibleBudgetError, match="smallest achievable"):
        graphckpt.plan(model, budget=0.01)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(segments=3, budget=0.5), "pass one"),
        (dict(segments=3, policy="save_expensive"), "can't be combined"),
        (dict(budget="1MiB"), "needs the batch size"),
        (dict(policy="save_everything"), "Accepted: \\['save_expensive', 'save_projections'\\]"),
        (dict(policy=3), "must be a name"),
        (dict(budget=0.5, batch_size=0), "batch_size"),
        (dict(budget=0.5, batch_size=True), "batch_size"),
        (dict(budget="12 parsecs", batch_size=4), "Accepted"),
    ],
)
def test_conflicting_or_bad_arguments(kwargs, match):
    model = models.chain(depth=6, width=8)
    with pytest.raises(graphckpt.InvalidArgumentError, match=match):
        graphckpt.checkpoint_model(model, **kwargs)


# ------------------------------------------------------------ exactness end to end


@pytest.mark.parametrize(
    "name, graph",
    [("chain", False), ("chain", True), ("resnet", True), ("unet", True), ("multi_io", False), ("masked_lstm", False)],
)
def test_budget_plans_are_exact(name, graph):
    model = models.ALL[name]()
    e = graphckpt.estimate(model, batch_size=64)
    assert e.smallest_peak_bytes < e.baseline_peak_bytes
    budget = (e.smallest_peak_bytes + e.baseline_peak_bytes) // 2
    ck = graphckpt.checkpoint_model(model, budget=budget, batch_size=64)
    segments = [layer for layer in ck.layers if isinstance(layer, Segment)]
    assert segments, "the budget plan should recompute something"
    compare_step(model, ck, models.sample_inputs(model), compiled=graph)
    if not graph:
        assert all(s.forward_calls >= 2 for s in segments)  # forward, then recompute


@MODES
def test_policy_keeps_expensive_calls_and_is_exact(graph):
    model = transformer_block()
    p = graphckpt.plan(model, policy="save_expensive", batch_size=4)
    assert p.strategy == "policy" and p.policy == "save_expensive"
    g = build_graph(model)
    expensive = {"Dense", "MultiHeadAttention"}
    for seg in p.segments:
        classes = {g.nodes[n]["class_name"] for n in seg.nodes}
        if seg.remat:
            assert not classes & expensive, classes
    assert any(s.remat for s in p.segments)
    assert p.estimated_peak_bytes < p.baseline_peak_bytes
    ck = graphckpt.checkpoint_model(model, policy="save_expensive", batch_size=4)
    kept_layers = {g.nodes[n]["layer"] for s in p.segments if not s.remat for n in s.nodes}
    assert kept_layers <= set(ck.layers)  # expensive calls run inline, not in a Segment
    compare_step(model, ck, models.sample_inputs(model), compiled=graph)


def test_policy_with_a_budget_and_named_layers():
    model = transformer_block()
    free = graphckpt.plan(model, budget=0.9, batch_size=4)
    p = graphckpt.plan(model, budget=0.9, batch_size=4, policy=graphckpt.policies.save_these_layers("Dense"))
    g = build_graph(model)
    assert all(g.nodes[n]["class_name"] != "Dense" for s in p.segments if s.remat for n in s.nodes)
    assert p.estimated_peak_bytes <= p.budget_bytes == free.budget_bytes


def masked_pooling():
    inp = keras.Input((6,), dtype="int32")
    x = layers.Embedding(20, 4, mask_zero=True)(inp)
    x = layers.Dense(4, activation="tanh")(x)
    x = layers.GlobalAveragePooling1D()(x)  # reads the mask op's output
    return keras.Model(inp, layers.Dense(1)(x), name="masked_pooling")


def test_bool_first_segment_output_is_differentiable():
    """Regression: a cut right after Embedding's mask op made a Segment whose
    first output is boolean; graph-mode recompute_grad read its gradient."""
    from graphckpt.runtime.checkpointed import checkpointed_model

    model = masked_pooling()
    g = build_graph(model)
    # In ASAP order, mask op first: the planner's own order runs it where
    # it is read (`graph.from_inputs`), where no cut falls right after it.
    asap = g.copy()
    asap.graph["from_inputs"] = frozenset()
    order = topological_order(asap)
    plans = [plan_from_boundaries(g, order, [0, b]) for b in range(1, len(order))]
    bool_first = [p for p in plans if g.graph["tensors"][p.segments[0].outputs[0]].dtype == "bool"]
    assert bool_first, [p.segments[0].outputs for p in plans]
    plan = bool_first[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck = checkpointed_model(model, g, plan)
    compare_step(model, ck, models.sample_inputs(model), compiled=True)


def test_smallest_peak_is_below_auto_and_sqrt_on_real_graphs():
    for name in ("resnet", "unet", "densenet"):
        model = models.ALL[name]()
        e = graphckpt.estimate(model, graphckpt.plan(model, batch_size=16, segments="sqrt"), batch_size=16)
        auto = graphckpt.plan(model, batch_size=16)
        # the default: within 1% of the least peak (recomputing least there)
        assert e.smallest_peak_bytes <= auto.estimated_peak_bytes <= 1.01 * e.smallest_peak_bytes
        assert e.smallest_peak_bytes <= e.peak_bytes < e.baseline_peak_bytes
        assert math.isclose(
            graphckpt.plan(model, budget=e.smallest_peak_bytes, batch_size=16).estimated_peak_bytes,
            e.smallest_peak_bytes,
            rel_tol=0.01,
        )
