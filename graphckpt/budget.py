"""Choosing a plan: segment counts, memory budgets and recompute policies.

`choose_plan` is what `graphckpt.plan` and `graphckpt.checkpoint_model`
run: it checks `segments` / `budget` / `batch_size` / `policy` together,
estimates per-call costs (`graphckpt.estimate`) and asks the pure planner
(`graphckpt.plan`) for the plan. Every plan it returns carries its
estimated peak and the baseline's.
"""

import dataclasses
import math
import numbers
import re

from graphckpt import errors, policies
from graphckpt.estimator.peak import node_costs, resolve_batch_size
from graphckpt.planner import (
    BudgetInfeasible,
    MemoryModel,
    baseline_peak,
    plan_for_budget,
    plan_from_boundaries,
    plan_segments,
    smallest_peak,
    topological_order,
)
from graphckpt.planner.data import format_bytes

__all__ = ["parse_budget", "choose_plan", "check_batch_size", "format_bytes", "BUDGET_FORMS"]

BUDGET_FORMS = (
    "an int number of bytes (e.g. 2_000_000_000), a string with a unit "
    "('512MiB', '2GiB', '2GB', '1.5 GB', '800 KB'), or a float in (0, 1): a "
    "fraction of the estimated baseline peak (e.g. 0.3)"
)

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BUDGET_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def _bad_budget(budget, why=""):
    return errors.InvalidArgumentError(
        f"Invalid `budget`{why}. Received: budget={budget!r}. Accepted: {BUDGET_FORMS}. "
        "Tip: `graphckpt.plan(model, batch_size=...)` shows the estimated baseline peak."
    )


def parse_budget(budget):
    """A `budget` argument -> `("bytes", int)` or `("fraction", float)`.

    Raises:
        graphckpt.InvalidArgumentError: not one of the accepted forms, or not
            positive.

    Example:
        >>> parse_budget("1.5 GiB"), parse_budget(0.3)
        (('bytes', 1610612736), ('fraction', 0.3))
    """
    if isinstance(budget, bool) or budget is None:
        raise _bad_budget(budget)
    if isinstance(budget, numbers.Integral):
        if budget <= 0:
            raise _bad_budget(budget, ": it must be positive")
        return "bytes", int(budget)
    if isinstance(budget, numbers.Real):
        value = float(budget)
        if not (0.0 < value < 1.0):
            raise _bad_budget(budget, ": a float is a fraction of the baseline, in (0, 1); pass bytes as an int")
        return "fraction", value
    if isinstance(budget, str):
        match = _BUDGET_RE.match(budget)
        if match is None or match.group(2).lower() not in _UNITS:
            raise _bad_budget(budget, ": not a number of bytes with a known unit")
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
        if not math.isfinite(value) or value < 1:
            raise _bad_budget(budget, ": it must be at least 1 byte")
        return "bytes", int(value)
    raise _bad_budget(budget)


def _with_estimates(plan, memory, batch_size, baseline, **extra):
    return dataclasses.replace(
        plan,
        estimated_peak_bytes=memory.estimated_peak(plan),
        baseline_peak_bytes=baseline,
        batch_size=batch_size,
        **extra,
    )


def _kept_plan(graph, strategy):
    """The plan that changes nothing: one segment, not recomputed."""
    order = topological_order(graph)
    return plan_from_boundaries(graph, order, [0], strategy=strategy, remat=[False])


def check_batch_size(graph, batch_size):
    """`batch_size` if given, else the graph's fixed batch dimension (or None).

    Raises:
        graphckpt.InvalidArgumentError: `batch_size` is not a positive int.
    """
    try:
        return resolve_batch_size(graph, batch_size)
    except ValueError as e:
        raise errors.InvalidArgumentError(f"{e}. Tip: pass the batch size you train with.") from None


def _empty_plan(graph, segments, budget, policy_name):
    """`(plan, unchanged)` for a model without layer calls (`Model(i, i)`):
    no segments, and why nothing changes. A budget is still checked."""
    if budget is not None:
        parse_budget(budget)
        strategy = "budget"
    else:
        named = isinstance(segments, str) and segments in ("auto", "sqrt")
        strategy = "policy" if policy_name else (segments if named else "fixed")
    the_plan = plan_from_boundaries(graph, (), [], strategy=strategy)
    return the_plan, "it has no layer calls (its outputs are its inputs), so there is nothing to recompute"


def choose_plan(graph, *, segments="auto", budget=None, batch_size=None, policy=None, attention_chunks=None):
    """Plans `graph` for the arguments of `graphckpt.plan`.

    Returns:
        `(plan, unchanged)`: `unchanged` is None, or a sentence saying why
        the model is best left as it is (the budget is at or above its
        estimated peak).

    Raises:
        graphckpt.InvalidArgumentError: bad or conflicting arguments.
        graphckpt.InfeasibleBudgetError: no plan's estimate fits `budget`.
    """
    explicit_segments = not (isinstance(segments, str) and segments == "auto")
    if budget is not None and explicit_segments:
        raise errors.InvalidArgumentError(
            f"`segments` and `budget` are two ways to choose a plan; pass one. Received: "
            f"segments={segments!r}, budget={budget!r}. Tip: drop `segments` to let the "
            "budget decide where to cut."
        )
    if policy is not None and explicit_segments:
        raise errors.InvalidArgumentError(
            f"`policy` chooses which calls are recomputed, so it can't be combined with a "
            f"segment count. Received: segments={segments!r}, policy={policy!r}. Tip: use "
            "`policy` alone, or with `budget`."
        )
    batch_size = check_batch_size(graph, batch_size)
    try:
        policy_name, policy_fn = policies.resolve(policy)
    except ValueError as e:
        raise errors.InvalidArgumentError(str(e)) from None
    if not topological_order(graph):
        return _empty_plan(graph, segments, budget, policy_name)
    costs = node_costs(graph, batch_size, attention_chunks)
    memory = MemoryModel(graph, costs)  # O(n^2): built once, read by every step below
    # The model's as it is: its attention cores whole.
    baseline = baseline_peak(graph, node_costs(graph, batch_size)) if attention_chunks else memory.baseline_peak()
    if budget is None and policy is None:
        try:
            the_plan = plan_segments(graph, segments=segments, costs=costs, memory=memory)
        except ValueError as e:
            raise errors.InvalidArgumentError(
                f"{e}. Accepted: 'auto' (the default: the least estimated peak, "
                "recomputing least), 'sqrt', or an int from 1 to the number of layer calls."
            ) from None
        return _with_estimates(the_plan, memory, batch_size, baseline), None
    keep = ()
    if policy_fn is not None:
        keep = tuple(n for n in topological_order(graph) if policy_fn(graph.nodes[n]["layer"]))
    per = "" if batch_size is not None else " per example"
    if budget is None:
        # Policy alone: the smallest estimated peak that recomputes none of
        # the saved calls, with the least recompute among such plans.
        target = smallest_peak(graph, costs, keep=keep, memory=memory)
        budget_bytes, strategy = None, "policy"
    else:
        kind, value = parse_budget(budget)
        if kind == "bytes" and batch_size is None:
            raise errors.InvalidArgumentError(
                f"A budget in bytes (budget={budget!r}) needs the batch size, and the model's "
                "batch dimension is not fixed. Tip: pass `batch_size=`, or give the budget as a "
                "fraction of the baseline, e.g. budget=0.4."
            )
        budget_bytes = value if kind == "bytes" else int(value * baseline)
        target, strategy = budget_bytes, "budget"
        if budget_bytes >= baseline:
            unchanged = (
                f"the budget ({format_bytes(budget_bytes)}{per}) is at or above the estimated "
                f"peak of the model without checkpointing ({format_bytes(baseline)}{per}), so "
                "checkpointing would only add recompute"
            )
            kept = _kept_plan(graph, strategy)
            return (
                _with_estimates(kept, memory, batch_size, baseline, budget_bytes=budget_bytes, policy=policy_name),
                unchanged,
            )
    try:
        the_plan = plan_for_budget(graph, costs, target, keep=keep, strategy=strategy, memory=memory)
    except BudgetInfeasible as e:
        what = " with policy " + repr(policy_name) if policy_name else ""
        raise errors.InfeasibleBudgetError(
            f"No plan{what} fits budget={budget!r} ({format_bytes(e.budget_bytes)}{per}): the "
            f"smallest achievable estimated peak is {format_bytes(e.smallest_bytes)}{per} "
            f"({e.smallest_bytes} bytes, {e.smallest_bytes / baseline:.0%} of the estimated "
            f"baseline {format_bytes(baseline)}). Tip: raise the budget to at least that, or "
            "lower the batch size."
        ) from None
    return (
        dataclasses.replace(
            the_plan, batch_size=batch_size, budget_bytes=budget_bytes, policy=policy_name, baseline_peak_bytes=baseline
        ),
        None,
    )
