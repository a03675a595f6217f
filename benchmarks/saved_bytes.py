"""What each backend keeps for one layer call's backward pass, against the
estimator's rule, for every probe of `tests/layer_probes.py` (exact counts:
saved tensors on PyTorch, vjp residuals on JAX, the gradient graph's reads
on TensorFlow; `tests/test_rule_saved_bytes.py` tests the same numbers).

    KERAS_BACKEND=torch python benchmarks/saved_bytes.py [--json PATH]

Prints, per probe, the measured and estimated bytes per example and their
difference in units of the call's float input and output bytes.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests import layer_probes  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    rows = {}
    for name, spec in layer_probes.probes().items():
        measured = layer_probes.measured_per_example(spec, np.random.default_rng(0))
        estimated, io = layer_probes.estimated_per_example(spec)
        rows[name] = {"measured": measured, "estimated": estimated, "io_bytes": io}
        if measured is None:
            print(f"{name:36s} measured      n/a  estimated {estimated:9.0f}")
        else:
            diff = (estimated - measured) / io if io else 0.0
            print(f"{name:36s} measured {measured:9.0f}  estimated {estimated:9.0f}  {diff:+6.2f} x in+out")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": keras.backend.backend(), "keras": keras.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
