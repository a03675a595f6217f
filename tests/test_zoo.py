"""Every `keras.applications` model rewrites and keeps equal outputs and
gradients (see `tests/zoo.py`). A few fast ones run in CI; all of them with
`-m slow`. `benchmarks/zoo_table.py` writes the results to `docs/zoo.md`.

A model graphckpt cannot rewrite gets a clear error that names the layer and
the reason, and is left as it was.
"""

import numpy as np
import pytest

import graphckpt
from tests import zoo
from tests.untouched import Snapshot


@pytest.mark.parametrize("name", zoo.CI)
def test_zoo_fast(name):
    result = zoo.check(name)
    assert result.segments > 1 and result.layer_calls > 100


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in zoo.ALL if n not in zoo.CI])
def test_zoo_all(name):
    zoo.check(name)


def test_zoo_lists_every_application():
    assert len(zoo.ALL) >= 40
    assert {"ResNet50V2", "DenseNet121", "EfficientNetB0", "NASNetLarge", "ConvNeXtXLarge"} <= set(zoo.ALL)


def test_a_model_that_cannot_be_rewritten_gets_a_clear_error():
    model = zoo.cannot_be_rewritten()
    snap = Snapshot(model, np.ones((2, 8), "float32"))
    with pytest.raises(graphckpt.UnsupportedModelError) as info:
        graphckpt.checkpoint_model(model, segments=3)
    message = str(info.value)
    assert "'call_me_once'" in message and "CallableOnce" in message  # the layer
    assert "this layer can only be called once" in message  # the reason
    assert "callable more than once" in message and "Tip" in message  # what to do
    # The calls replayed before the failure are removed again.
    snap.assert_untouched(model, nodes=True)
