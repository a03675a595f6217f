"""Proof that a `checkpoint_model` call left the user's model as it was:
same config, same variable values, same predictions, and it still saves and
loads."""

import json

import keras
import numpy as np
from keras import tree

from tests.helpers import state_of


def _predict(model, x):
    return [keras.ops.convert_to_numpy(y) for y in tree.flatten(model(x, training=False))]


def _node_counts(model):
    return {id(layer): (len(layer._inbound_nodes), len(layer._outbound_nodes)) for layer in model._flatten_layers()}


class Snapshot:
    """What a model looked like before a `checkpoint_model` call."""

    def __init__(self, model, x):
        self.x = x
        self.config = json.dumps(model.get_config(), sort_keys=True, default=repr)
        self.state = state_of(model)
        self.prediction = _predict(model, x)
        self.layers = list(model.layers)
        self.nodes = _node_counts(model)

    def assert_untouched(self, model, tmp_path=None, nodes=False):
        """Asserts `model` matches the snapshot. With `tmp_path`, also saves
        it as `.keras` and checks the loaded copy predicts the same. With
        `nodes`, also checks no layer gained or lost a call (a failed rewrite
        must remove the calls it replayed)."""
        assert json.dumps(model.get_config(), sort_keys=True, default=repr) == self.config, "get_config() changed"
        assert model.layers == self.layers, "the model's layer list changed"
        after = state_of(model)
        assert len(after) == len(self.state), "the model gained or lost variables"
        for v, a, b in zip(model.variables, after, self.state):
            np.testing.assert_array_equal(a, b, err_msg=f"value of {v.path} changed")
        for a, b in zip(_predict(model, self.x), self.prediction):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg="predictions changed")
        if nodes:
            assert _node_counts(model) == self.nodes, "layer calls were added or removed"
        if tmp_path is not None:
            path = tmp_path / "original.keras"
            model.save(path)
            loaded = keras.models.load_model(path)
            for a, b in zip(_predict(loaded, self.x), self.prediction):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg="loaded copy predicts differently")
            path.unlink()
