"""Weights files of a checkpointed model: the very files its source model writes.

Keras saves a model's weights (`save_weights`, and so
`ModelCheckpoint(save_weights_only=True)` and `BackupAndRestore`) by walking
the model: each layer's variables go under the path of attribute and class
names that leads to the layer (`layers/dense_1/vars/0`). Walked as it is, a
checkpointed model puts them under its segments
(`layers/segment/model/layers/dense/vars/0`), so a file of the plain model
and a file of the checkpointed one do not load into each other, and a layer
that two segments share is written under the first only.

So `CheckpointedModel.save_weights` and `load_weights` let Keras walk a
stand-in, `SourceLayout`: the source model's layers, where the source model
has them, and the checkpointed model's own state (optimizer, compiled
losses and metrics, own variables), where every compiled model has it. The
variables are the same objects, so the file is the one the source model
would write if it were compiled like the checkpointed model. Optimizer
slots line up too: a checkpointed model lists its variables in its source's
order, so its optimizer builds its slots in that order.

A load that fails restores every variable it may have written (model,
optimizer, metrics) and raises one `InvalidArgumentError`.

`.keras` archives written by `CheckpointedModel.save` keep Keras's own walk
of the checkpointed model (`keras.saving.load_model` needs it: it loads the
archive's weights into the checkpointed model it rebuilds). `load_weights`
reads such an archive the same way when its plan is this model's plan, and
refuses one with another plan, which would put weights in the wrong layers.
"""

import json
import zipfile

import keras
import numpy as np

from graphckpt import errors, keras_compat

# Keras has no public spelling of the saveable protocol and its walk.
_, KerasSaveable = keras_compat.saving_modules()

__all__ = ["SourceLayout", "save_weights", "load_weights"]


def _holds(value, ids, seen=None):
    """Whether `value` is, or a list/tuple/dict in it holds, an object whose
    id is in `ids`."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return False
    seen.add(id(value))
    if isinstance(value, KerasSaveable):
        return id(value) in ids
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds(v, ids, seen) for v in value)
    return False


def _own_state_names(model):
    """The attributes Keras saves for `model` besides its layer graph: its
    optimizer, compiled loss and metrics, and any saveable the user attached
    to it; not `layers` nor the containers of its layers."""
    graph = {id(op) for op in model.operations}
    names = []
    for name, value in keras_compat.walk_saveable(model):
        if name == "layers" or name in names or _holds(value, graph):
            continue
        if isinstance(value, (KerasSaveable, list, tuple, dict)):
            names.append(name)
    return names


class SourceLayout(KerasSaveable):
    """What Keras's weight saving walks in place of a checkpointed model.

    Keras walks a model's `layers` first, then its other attributes. This
    object gives the source model's layers as `layers` (and the source's
    object type, Functional or Sequential, which decides how Keras names
    them), and for every other attribute the checkpointed model's own, so
    the optimizer and compiled metrics are saved under the same names as
    for any model.

    Args:
        model: a `CheckpointedModel`.
    """

    def __init__(self, model):
        self.__dict__.update(_model=model, _state_names=_own_state_names(model))

    def _obj_type(self):
        return keras_compat.saveable_type(self._model._graphckpt_recipe.source)

    @property
    def layers(self):
        return self._model._graphckpt_recipe.source.layers

    def __dir__(self):
        return ["layers", *self._state_names]

    def __getattr__(self, name):
        # Only reached for names not defined here: the model's own.
        return getattr(self.__dict__["_model"], name)


def save_weights(model, filepath, overwrite=True, max_shard_size=None):
    """Writes `model`'s weights as its source model writes its own.

    Args:
        model: a `CheckpointedModel`.
        filepath, overwrite, max_shard_size: as for `keras.Model.save_weights`.
    """
    keras.saving.save_weights(SourceLayout(model), filepath, overwrite=overwrite, max_shard_size=max_shard_size)


def _variables_to_restore(model):
    """Every variable a weights load may assign: the model's, its
    optimizer's and its metrics'. Deduplicated, in a fixed order."""
    optimizer = getattr(model, "optimizer", None)
    groups = [model.variables, getattr(optimizer, "variables", []), model.metrics_variables]
    seen, out = set(), []
    for v in (v for group in groups for v in group):
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def _snapshot(variables):
    # A copy: on torch, numpy views share the tensor's storage, which an
    # in-place assign would change.
    return [np.array(keras.ops.convert_to_numpy(v.value), copy=True) for v in variables]


def _plan_signature(config):
    """A checkpointed model's config (`CheckpointedModel.get_config()`) as
    data that does not depend on layer names: the source's layer classes,
    and each segment's calls as (layer position, call) pairs. Two models
    with the same signature walk to the same weight paths."""
    entries = config["source"]["config"]["layers"]
    layers = [e for e in entries if e["class_name"] != "InputLayer"]
    position = {e["config"]["name"]: i for i, e in enumerate(layers)}
    plan = config["plan"]
    segments = [[(position[name], int(k)) for name, k in seg] for seg in plan["segments"]]
    remat = [bool(r) for r in plan.get("remat", [True] * len(segments))]
    return [e["class_name"] for e in layers], segments, remat


def _archived_checkpointed_config(filepath):
    """The `CheckpointedModel` config of a `.keras` archive, or None when
    the archive holds another model (or is no `.keras` archive)."""
    path = str(filepath)
    if not path.endswith(".keras") or not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
    if config.get("registered_name") != "graphckpt>CheckpointedModel":
        return None
    return config["config"]


def _legacy_layer_names(filepath):
    """Names of the layers with weights in a legacy `.h5` file, in order."""
    import h5py

    with h5py.File(str(filepath), "r") as f:
        group = f["model_weights"] if "layer_names" not in f.attrs and "model_weights" in f else f
        legacy = keras_compat.legacy_h5_format()
        names = legacy.load_attributes_from_hdf5_group(group, "layer_names")
        return [n for n in names if legacy.load_attributes_from_hdf5_group(group[n], "weight_names")]


def _keras_walk(model, filepath):
    """True when `filepath` holds `model`'s weights as Keras walks the
    checkpointed model itself (its segments), not as its source has them.

    Raises:
        graphckpt.InvalidArgumentError: a `.keras` archive of a
            checkpointed model with another plan.
    """
    config = _archived_checkpointed_config(filepath)
    if config is not None:
        mine = model.get_config()
        try:
            same = _plan_signature(config) == _plan_signature(mine)
        except (KeyError, TypeError, ValueError):
            same = False
        if not same:
            raise errors.InvalidArgumentError(
                f"'{filepath}' holds a checkpointed model with another plan than model "
                f"'{model.name}' (or another source model): its weights are stored by segment, and "
                "this model's segments hold other layers. Nothing was loaded. Expected a weights file "
                "of the source model, or a `.keras` archive of a checkpointed model with this plan. "
                "Tip: `loaded = keras.saving.load_model(path)`, then "
                "`model.set_weights(loaded.get_weights())`; or save with `save_weights`, whose files "
                "fit every checkpointed model of the same source."
            )
        return True
    path = str(filepath)
    if path.endswith((".h5", ".hdf5")) and not path.endswith(".weights.h5"):
        # A legacy file that `CheckpointedModel.save("x.h5")` wrote names
        # the segments themselves.
        native = [l.name for l in model.layers if l.weights]
        try:
            return _legacy_layer_names(filepath) == native
        except (OSError, KeyError):
            return False
    return False


def load_weights(model, filepath, keras_load, skip_mismatch=False, **kwargs):
    """Loads a weights file into `model`, or changes nothing and raises.

    Args:
        model: a `CheckpointedModel`.
        filepath: a weights file of its source model (`.weights.h5`,
            `.weights.json`, a `.keras` archive, a legacy `.h5`), or one
            written by `model` itself.
        keras_load: Keras's own `load_weights`, bound to `model`: it reads
            files stored by segment.
        skip_mismatch, **kwargs: as for `keras.Model.load_weights`.

    Raises:
        graphckpt.InvalidArgumentError: the file does not fit `model`.
        graphckpt.WeightsFileError: the file could not be read (an
            `OSError`, as Keras raises; `WeightsFileNotFoundError`, a
            `FileNotFoundError`, when it does not exist).
        In every case the model's variables, optimizer and metrics are as
        before the call.
    """
    variables = _variables_to_restore(model)
    before = _snapshot(variables)
    try:
        if _keras_walk(model, filepath):
            keras_load(filepath, skip_mismatch=skip_mismatch, **kwargs)
        else:
            keras.saving.load_weights(SourceLayout(model), filepath, skip_mismatch=skip_mismatch, **kwargs)
    except Exception as e:
        for v, value in zip(variables, before):
            v.assign(value)
        if isinstance(e, errors.GraphckptError):
            raise
        source = model._graphckpt_recipe.source
        # The error Keras raises for the plain model, with graphckpt's message.
        kind = errors.InvalidArgumentError
        if isinstance(e, FileNotFoundError):
            kind = errors.WeightsFileNotFoundError
        elif isinstance(e, OSError):
            kind = errors.WeightsFileError
        raise kind(
            f"Could not load weights from '{filepath}' into checkpointed model '{model.name}': "
            f"{type(e).__name__}: {e} Nothing was changed: the model's variables and its "
            f"optimizer's are as they were. Expected a weights file of its source model "
            f"'{source.name}' or of a model of the same architecture (from `save_weights`, "
            "`ModelCheckpoint`, `BackupAndRestore`, a `.keras` archive or a legacy `.h5` file), "
            "or one this checkpointed model wrote. Tip: `skip_mismatch=True` loads the layers "
            "that fit and skips the rest."
        ) from e
