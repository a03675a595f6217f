"""What the fit flag reads from the data passed to `fit`: the shapes of
its first batch, to plan for, and, for an unbuilt Sequential, the batch
Keras's trainer would build it on."""

import inspect
import math
import warnings

import keras

from graphckpt import errors, keras_compat

__all__ = ["with_data_shapes", "data_shapes", "checked_shapes", "is_batched", "build_like_fit", "first_batch"]


def with_data_shapes(planner_kwargs, original, model, args, kwargs):
    """Plans for the data `fit` trains on: `(with_shapes, without)`, the
    planner arguments with the shapes of its first batch (`input_shape=`;
    not yet checked against the model), and those to plan with if they
    don't fit it: for a byte budget, the batch size `fit` uses."""
    bound = inspect.signature(original).bind_partial(model, *args, **kwargs).arguments
    x, batch_size = bound.get("x"), bound.get("batch_size")
    if not is_batched(x) and batch_size is None:
        batch_size = 32  # what `fit` uses for arrays
    without = dict(planner_kwargs, batch_size=batch_size) if "budget" in planner_kwargs else planner_kwargs
    shapes = data_shapes(x, batch_size, bound.get("validation_split") or 0.0)
    if shapes is None:
        return without, without
    each = shapes.values() if isinstance(shapes, dict) else [shapes] if isinstance(shapes, tuple) else shapes
    with_shapes = dict(planner_kwargs, input_shape=shapes)
    if not is_batched(x) and any(s[0] is None for s in each):
        with_shapes["batch_size"] = batch_size  # the full batches' size, to estimate with
    return with_shapes, without


def _shape(dims):
    return tuple(None if d is None else int(d) for d in dims)


def data_shapes(x, batch_size, validation_split):
    """The input shapes of the first batch `fit` takes from `x`, as
    `input_shape=` spells them, or None when they can't be read without
    consuming data.

    Arrays (and dicts, lists, tuples of arrays): `fit` takes batches of
    `batch_size` from the examples it trains on. A `tf.data` dataset: its
    `element_spec` (the batch dimension may be unknown). Keras `PyDataset`s
    and generators are not read: peeking would run or consume the user's
    data pipeline (its augmentation's random draws included)."""
    from keras import tree
    from keras.utils import unpack_x_y_sample_weight

    if x is None:
        return None
    if not is_batched(x):
        leaves = tree.flatten(x)
        if not leaves or not all(hasattr(leaf, "shape") and len(leaf.shape) for leaf in leaves):
            return None
        examples = int(leaves[0].shape[0])
        examples = int(math.ceil(examples * (1.0 - validation_split)))
        step = max(1, min(batch_size, examples))
        # A partial last batch: the batch dimension varies (None), as in
        # the spec of a dataset that ends in one.
        batch = step if examples % step == 0 else None
        return _as_input_shape(tree.map_structure(lambda a: (batch,) + _shape(a.shape[1:]), x))
    spec = getattr(x, "element_spec", None)
    if spec is None:
        return None
    x_spec = unpack_x_y_sample_weight(spec)[0]
    try:
        shapes = tree.map_structure(lambda s: _shape(s.shape), x_spec)
    except (AttributeError, TypeError, ValueError):  # specs of unknown rank
        return None
    if any(d is None for spec in tree.flatten(x_spec) for d in _shape(spec.shape)[1:]):
        return None  # padded or ragged batches: lengths vary from batch to batch
    return _as_input_shape(shapes)


def _as_input_shape(shapes):
    """A structure of shapes -> `input_shape=`'s spelling (a tuple, a list
    of tuples or a dict of tuples), or None for deeper nesting."""
    if isinstance(shapes, dict):
        flat = all(isinstance(s, tuple) for s in shapes.values())
        return dict(shapes) if flat else None
    if isinstance(shapes, list) or (isinstance(shapes, tuple) and shapes and isinstance(shapes[0], tuple)):
        return list(shapes) if all(isinstance(s, tuple) for s in shapes) else None
    return shapes


def checked_shapes(model, shapes):
    """`shapes` if the planner accepts them for `model`, else None, with a
    warning: `fit` itself will say what is wrong with the data."""
    if shapes is None:
        return None
    from graphckpt.graph.build import build_graph
    from graphckpt.graph.shapes import parse_input_shape

    try:
        parse_input_shape(build_graph(model), shapes)
    except errors.GraphckptError as e:
        warnings.warn(
            f"Model '{model.name}': gradient checkpointing plans without the shapes of the data "
            f"passed to fit, which don't fit the model's inputs: {e}",
            errors.GraphckptWarning,
            stacklevel=6,
        )
        return None
    except Exception:  # noqa: BLE001 - not a model graphckpt reads: `plan` says why
        return None
    return shapes


def is_batched(x):
    """True for inputs that bring their own batches (datasets, generators,
    `keras.utils.PyDataset`), for which `fit` ignores `batch_size`."""
    return x is not None and not hasattr(x, "shape") and not isinstance(x, (list, tuple, dict))


def build_like_fit(model, original, args, kwargs):
    """Builds an unbuilt Sequential as `fit` would on its first batch, so
    that it has a layer graph to plan: Keras's trainer runs the model
    symbolically on a batch of the data's shapes and dtypes
    (`backend.compute_output_spec(model, x, training=False)`)."""
    if not isinstance(model, keras.Sequential) or model.built:
        return
    batch = first_batch(model, original, args, kwargs, "is not built, and the flag plans on its layer graph, so it builds the model")
    from keras import tree

    shapes = [tuple(t.shape) for t in tree.flatten(batch)]
    if len(shapes) == 1 and None in shapes[0]:
        # What running it on such a batch builds, on every backend (PyTorch's
        # symbolic run would put a placeholder size in place of None).
        model.build(shapes[0])
    else:
        keras_compat.compute_output_spec(model, batch, training=False)


def first_batch(model, original, args, kwargs, why):
    """`KerasTensor`s like the first batch `fit` feeds `model` (a structure
    like `x`). Arrays are read as the trainer batches them
    (`keras_compat.first_batch_spec`), a `tf.data` dataset by its
    `element_spec`. Other data (generators, `PyDataset`s) can't be read
    without consuming it, so it is refused, saying `why` it is needed."""
    from keras import tree
    from keras.utils import unpack_x_y_sample_weight

    bound = inspect.signature(original).bind_partial(model, *args, **kwargs).arguments
    x, batch_size = bound.get("x"), bound.get("batch_size") or 32
    spec = getattr(x, "element_spec", None)
    if spec is not None:
        x_spec = unpack_x_y_sample_weight(spec)[0]
        return tree.map_structure(lambda s: keras.KerasTensor(tuple(s.shape), dtype=s.dtype.name), x_spec)
    if data_shapes(x, batch_size, 0.0) is not None and not is_batched(x):
        examples = len(tree.flatten(x)[0])
        train = int(math.ceil(examples * (1.0 - (bound.get("validation_split") or 0.0))))
        return keras_compat.first_batch_spec(tree.map_structure(lambda a: a[:train], x), batch_size)
    kind = "Sequential model" if isinstance(model, keras.Sequential) else "Model"
    raise errors.UnsupportedModelError(
        f"{kind} '{model.name}' {why} from the data's first batch, as `fit` would. It cannot read that "
        f"batch from x of type {type(x).__name__} without consuming it (expected arrays or a "
        "`tf.data.Dataset`). Tip: "
        + (
            "build the model first: `keras.Input(shape)` as its first layer, or `model.build((None, ...))`."
            if isinstance(model, keras.Sequential)
            else "pass arrays or a `tf.data.Dataset` to `fit`, or fit without the flag."
        )
    )
