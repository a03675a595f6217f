"""The planner's answers on stored graphs are the answers it gave before.

Each case in `cases/` is a real model's layer-call graph (or a random DAG)
with its per-call costs and the planner's answers to a list of queries
(default, sqrt and fixed-count plans; budget plans across the feasible
range and just below it, with and without calls that may not be
recomputed; smallest and baseline peaks), written by `make_cases.py` with
the planner before its speed-up (commit 325211c). Replaying them checks
that every boundary, recompute flag, estimate and segment of every plan is
unchanged. No Keras is imported.
"""

import os

import pytest

from tests.planner import casefile

# Slow to replay (seconds to minutes each): run with -m slow.
LARGE = {"nasnetlarge", "dense_chain_2000", "densenet121", "efficientnetb0", "mobilenetv2", "dense_chain_200"}


def _params():
    params = []
    for path in casefile.case_paths():
        name = os.path.basename(path).split(".")[0]
        marks = [pytest.mark.slow] if name in LARGE else []
        params.append(pytest.param(path, id=name, marks=marks))
    return params


@pytest.mark.parametrize("path", _params())
def test_answers_are_unchanged(path):
    data, graph, costs = casefile.read_case(path)
    for query, expected in zip(data["queries"], data["answers"]):
        assert casefile.answer(graph, costs, query) == expected, query


def test_cases_cover_every_kind_of_query():
    """The stored queries exercise each search, feasible and infeasible budgets."""
    kinds, infeasible, with_keep = set(), 0, 0
    for path in casefile.case_paths():
        data, _, _ = casefile.read_case(path)
        for query, expected in zip(data["queries"], data["answers"]):
            kinds.add(query["kind"] if query["kind"] != "segments" else f"segments={query['segments']}")
            infeasible += "infeasible" in expected
            with_keep += bool(query.get("keep"))
    assert {"baseline", "smallest", "budget", "segments=auto", "segments=sqrt"} <= kinds
    assert infeasible >= 10 and with_keep >= 10
