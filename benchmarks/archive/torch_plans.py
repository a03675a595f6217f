"""PyTorch plans made with PyTorch's memory model, against the plans made
without it.

Keras's torch trainer runs the forward pass, then `zero_grad()`, then the
backward pass, so the backward pass runs on the memory of the last step's
weight gradients. Planned at the step's batch size, the estimator counts
them (`NodeCosts.freed`); per example (no batch size given) it cannot, and
plans as on TensorFlow.

The Dense chain of issue 14 (`depth` x Dense(1024, tanh), then Dense(1);
batch 256, SGD, MSE), PyTorch on the CPU, memory by process RSS
(`graphckpt.measure`, each run in a fresh process), methods alternating,
medians of per-round ratios to the Keras baseline:

    keras           the model as it is
    per example     graphckpt.checkpoint_model(model): no batch size, the
                    memory model of TensorFlow
    at batch 256    graphckpt.checkpoint_model(model, batch_size=256): the
                    default plan with PyTorch's memory model (what the fit
                    flag plans, which knows the batch)
    budget B        graphckpt.checkpoint_model(model, budget=B, batch_size=256):
                    the least recompute whose estimated peak fits B of the
                    estimated baseline; B = issue 14's peak line at this depth

    PYTHONPATH=. .venv/bin/python benchmarks/archive/torch_plans.py [--depth 32] [--repeats 3] [--out FILE]
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.getcwd())

from forward_walk import main  # noqa: E402

PEAK_LINE = {32: 0.40, 64: 0.30}  # issue 14: PyTorch peak ratio at or below


def methods(depth):
    line = PEAK_LINE.get(depth, 0.40)
    return {
        "keras": dict(method="baseline"),
        "per example": dict(method="graphckpt"),
        "at batch 256": dict(method="graphckpt", checkpoint_kwargs={"batch_size": 256}),
        f"budget {line:.2f}": dict(method="graphckpt", checkpoint_kwargs={"budget": line, "batch_size": 256}),
    }


if __name__ == "__main__":
    main(methods, __doc__)
