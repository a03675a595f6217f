"""Every use graphckpt makes of Keras's (and keras_hub's, TensorFlow's)
private API: the only module that reads it, each function saying what it
reads and why no public way serves. Version differences live here too.
Tested against the oldest and newest Keras of pyproject.toml's range and
keras-nightly (`make test`). Keras is imported lazily.

Two private methods are overridden where graphckpt's classes are defined,
since an override cannot live here: `Functional._run_through_graph`
(`CheckpointedModel`: `clone_model` clones through the plan) and
`KerasSaveable._obj_type` (`graphckpt.runtime.weights`). `tests/test_structure.py`
checks that no other module reads a private name.
"""

import contextlib
import functools


def functional_class():
    """`keras.src.models.functional.Functional`: the class of models built
    as `keras.Model(inputs, outputs)`. Public alternative: none (a
    functional model is a `keras.Model` whose class is this one)."""
    from keras.src.models.functional import Functional

    return Functional


def is_functional(model):
    return isinstance(model, functional_class())


def sequential_functional(model):
    """The Functional a built Sequential keeps its graph in
    (`Sequential._functional`). No public way: `model.inputs`/`outputs` give tensors, not nodes."""
    return model._functional


def nodes_by_depth(fn):
    """`Functional._nodes_by_depth`: depth -> nodes, depth 0 at the outputs.
    No public walk of a model's calls."""
    return fn._nodes_by_depth


def nodes_of(fn):
    """`fn`'s nodes in Keras's execution order (inputs first), as
    `Function._run_through_graph` walks them."""
    by_depth = nodes_by_depth(fn)
    return [node for depth in sorted(by_depth, reverse=True) for node in by_depth[depth]]


def set_nodes_by_depth(fn, nodes):
    """Replaces a Functional's node order (graphckpt's rewrite fixes the
    order in which a rewritten model runs its calls). No public way."""
    fn._nodes_by_depth = nodes


def run_freeing_dead_tensors(fn, inputs, operation_fn=lambda op: op, call_fn=None):
    """`Function._run_through_graph(inputs, operation_fn)`, the walk a
    Functional's `call` runs, but each intermediate tensor is dropped once
    the last call that reads it has run.

    Keras's own walk keeps every intermediate until the call returns: free
    in a plain training step, whose backward pass keeps them anyway, but a
    recomputed segment's forward pass keeps nothing for backward, and would
    hold its whole interior at once. The calls run in Keras's order, with
    the same arguments: results are the same. Symbolic walks (`call_fn`) go
    to Keras's own. Keras 3.15's `Functional.call` passes an `operation_fn`
    that injects `training`; 3.16's passes none (the call context carries
    it). No public way: Keras has no hook into a model's graph walk.
    """
    if call_fn is not None:
        return type(fn)._run_through_graph(fn, inputs, operation_fn=operation_fn, call_fn=call_fn)
    from keras import tree

    nodes = [node for node in nodes_of(fn) if node.operation and not node.is_input]
    reads = [{id(x) for x in node.input_tensors} for node in nodes]
    uses = {}
    for ids in reads:
        for i in ids:
            uses[i] = uses.get(i, 0) + 1
    outputs = {id(x) for x in fn.outputs}
    values = {id(x): y for x, y in zip(fn.inputs, tree.flatten(inputs))}
    operation_for = getattr(fn, "_get_operation_for_node", lambda node: node.operation)
    for node, ids in zip(nodes, reads):
        if any(i not in values for i in ids):
            continue  # not computable, as Keras skips it
        args, kwargs = node.arguments.fill_in(values)
        made = operation_fn(operation_for(node))(*args, **kwargs)
        values.update(zip((id(x) for x in node.outputs), tree.flatten(made)))
        del args, kwargs, made
        for i in ids:
            uses[i] -= 1
            if not uses[i] and i not in outputs:
                del values[i]
    missing = [x.name for x in fn.outputs if id(x) not in values]
    if missing:
        raise ValueError(f"Outputs {missing} of '{fn.name}' are not connected to its inputs.")
    return tree.pack_sequence_as(fn._outputs_struct, [values[id(x)] for x in fn.outputs])


@contextlib.contextmanager
def freeing_dead_tensors(fn):
    """Within it, calls of the Functional `fn` walk their graph with
    `run_freeing_dead_tensors`: an instance attribute shadows
    `Function._run_through_graph` and is removed on exit, so `fn` is left
    as it was. Anything else passes through unchanged."""
    if not is_functional(fn):
        yield
        return
    fn.__dict__["_run_through_graph"] = functools.partial(run_freeing_dead_tensors, fn)
    try:
        yield
    finally:
        fn.__dict__.pop("_run_through_graph", None)


def inbound_nodes(layer):
    """The calls of a layer, in order (`Layer._inbound_nodes`); a call's
    index in it is Keras's node index. No public way: `layer.input` gives one call's tensors."""
    return layer._inbound_nodes


def call_counts(layer):
    """(calls, consumers) recorded on a layer, for `truncate_calls`."""
    return len(layer._inbound_nodes), len(layer._outbound_nodes)


def truncate_calls(layer, n_in, n_out):
    """Forgets the calls recorded on `layer` after `call_counts` gave
    (n_in, n_out): symbolic calls made while building a rewrite must not
    stay on the user's layers. No public way: Keras never forgets a call."""
    del layer._inbound_nodes[n_in:]
    del layer._outbound_nodes[n_out:]


def keras_history(tensor):
    """(operation, node index, tensor index) of a symbolic tensor
    (`KerasTensor._keras_history`). No public way: it is how Keras links a tensor to its call."""
    return tensor._keras_history


def compute_output_spec(fn, *args, **kwargs):
    """`keras.src.backend.compute_output_spec`: runs `fn` symbolically.
    Public: `Layer.compute_output_spec`, per layer only."""
    from keras.src import backend

    return backend.compute_output_spec(fn, *args, **kwargs)


def first_batch_spec(x, batch_size):
    """`KerasTensor`s of the first batch of the arrays `x` as Keras's trainer
    feeds a model it builds (`Trainer._symbolic_build`): TensorFlow's array
    adapter makes the batch dimension None when a partial batch ends the
    epoch; JAX's and PyTorch's numpy batches have `min(batch_size, n)`.
    No public way: each trainer's data adapter decides."""
    import keras
    from keras import tree

    if keras.backend.backend() == "tensorflow":
        from keras.src.trainers.data_adapters import get_data_adapter

        spec = get_data_adapter(x, batch_size=batch_size, shuffle=False).get_tf_dataset().element_spec
        specs = tree.flatten(spec)
    else:
        specs = [a[:batch_size] for a in tree.flatten(x)]
    return tree.pack_sequence_as(
        x, [keras.KerasTensor(tuple(s.shape), dtype=keras.backend.standardize_dtype(s.dtype)) for s in specs]
    )


def norms_keep_centered_input():
    """Whether Keras's layer and group normalization keep an input-sized
    centered tensor for their gradient: from Keras 3.16 they compute
    `(x - mean) * inv` (3.15 folds the mean into an offset), except on
    PyTorch, whose fused op 3.16 uses. Read from the version: the formula
    is inside a private function."""
    import keras

    major, minor = (int(p) for p in keras.version().split(".")[:2])
    return (major, minor) >= (3, 16) and keras.backend.backend() != "torch"


def compile_config(model):
    """The config `compile` recorded (`Model._compile_config`), or None.
    Public: `get_compile_config`, serialized."""
    return getattr(model, "_compile_config", None)


def compile_arguments(model):
    """The arguments of `model`'s last `compile` (the objects themselves),
    or None. Public: `get_compile_config()`, serialized copies."""
    config = compile_config(model)
    if not getattr(model, "compiled", False) or config is None:
        return None
    return dict(config.config)


def clear_losses(layer):
    """`Layer._clear_losses()`: drops the losses a call added. No public way."""
    layer._clear_losses()


def clone_function():
    """`keras.src.models.cloning.clone_model` with the private arguments
    graphckpt needs. Public alternative: `keras.models.clone_model` (the
    same function)."""
    from keras.src.models import cloning

    return cloning


def global_attribute(name):
    """A Keras global (`global_state`): "autocast_scope",
    "global_seed_generator". No public way."""
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute(name)


def set_global_attribute(name, value):
    """Sets a Keras global (see `global_attribute`)."""
    from keras.src.backend.common import global_state

    global_state.set_global_attribute(name, value)


def get_keras_mask(x):
    """The mask Keras attached to a tensor (`_keras_mask`), or None.
    Public alternative: none (masks travel as a private attribute)."""
    from keras.src.backend.common import masking

    return masking.get_keras_mask(x)


def set_keras_mask(x, mask):
    """Attaches `mask` to `x` as Keras's masking layers do."""
    from keras.src.backend.common import masking

    masking.set_keras_mask(x, mask)


def enclosing_stateless_scope():
    """The `StatelessScope` a call runs in (JAX's trainer runs whole steps
    in one), or None. Public alternative: `keras.StatelessScope` opens a
    scope; nothing finds the enclosing one."""
    from keras.src.backend.common import stateless_scope

    return stateless_scope.get_stateless_scope() if stateless_scope.in_stateless_scope() else None


def takes_call_context_arg(layer, name):
    """Whether `layer`'s `call` takes the call-context argument `name`
    (`Layer._call_has_context_arg`). Passing it to one whose `call` ignores
    it records it in Keras's call context, which later calls inherit."""
    return bool(getattr(layer, "_call_has_context_arg", {}).get(name, False))


def recorded_training_wins():
    """Whether a call's recorded `training=` wins over the one its model
    runs with: from Keras 3.16 (keras PR 23364) it does; up to 3.15
    `Functional.call` injects the model's into every call through
    `operation_fn` (read from its code: whether it names `operation_fn`)."""
    return "operation_fn" not in functional_class().call.__code__.co_names


def resolve_training(enclosing, recorded):
    """The `training=` a call recorded with `recorded` (None: not given)
    runs with inside nested calls that passed `enclosing` explicitly (None:
    none did), as the running Keras resolves it."""
    if recorded_training_wins():
        return recorded if recorded is not None else enclosing
    return enclosing if enclosing is not None else recorded


def keep_input_dtypes(layer):
    """Makes `layer.__call__` pass its inputs on as they are, without
    casting them to its compute dtype (`Layer._convert_input_args`).
    Public: `autocast=False`, for variables only."""
    layer._convert_input_args = False


def is_clone_operation_fn(operation_fn):
    """Whether `operation_fn`, passed to `Functional._run_through_graph`,
    is `keras.models.clone_model`'s: it returns a clone of each layer
    rather than calling it. Public alternative: none."""
    from keras.src.models import cloning

    return getattr(operation_fn, "__module__", None) == cloning.__name__ and getattr(
        operation_fn, "__qualname__", ""
    ).startswith("_clone_functional_model.")


def hub_class(module, name):
    """The class `name` of keras_hub's private module `module` (a path
    under `keras_hub.src.`), or None in a keras_hub version without it.
    Public alternative: `keras_hub.layers` exports some, not all."""
    import importlib

    try:
        return getattr(importlib.import_module(f"keras_hub.src.{module}"), name)
    except (ImportError, AttributeError):
        return None


def hub_model_modules():
    """(name, module) of every keras_hub model module loaded so far
    (`keras_hub.src.models.*`), where its attention layers are defined. Not exported."""
    import sys

    return [(name, module) for name, module in list(sys.modules.items()) if name.startswith("keras_hub.src.models.")]


def saving_modules():
    """(`saving_lib`, `KerasSaveable`): reading and writing weights files
    exactly as Keras does. Public: `keras.saving`, which takes no stand-in object."""
    from keras.src.saving import saving_lib
    from keras.src.saving.keras_saveable import KerasSaveable

    return saving_lib, KerasSaveable


def legacy_h5_format():
    """Keras's reader of legacy `.h5` weights files (imported when one is read). No public way."""
    from keras.src.legacy.saving import legacy_h5_format as module

    return module


def tf_eager_internals():
    """(`context`, `record`) from `tensorflow.python.eager`: whether a
    gradient function runs eagerly, and `record.stop_recording()` to run a
    forward pass unrecorded by every tape. Public alternatives:
    `tf.executing_eagerly()`; `GradientTape.stop_recording()` covers one
    tape only."""
    from tensorflow.python.eager import context, record

    return context, record


def structures(fn):
    """(inputs, outputs) of a Functional in the structure it was built with
    (`Functional._inputs_struct` / `_outputs_struct`: a dict, a list or one
    tensor). Public alternative: `fn.inputs` / `fn.outputs`, flattened."""
    return fn._inputs_struct, fn._outputs_struct


def sublayers(layer, include_self=True):
    """`layer` (unless `include_self` is false) and every layer inside it,
    recursively (`Layer._flatten_layers`). Public alternative:
    `Model.layers`, one level and models only."""
    return list(layer._flatten_layers(include_self=include_self))


def untracked_variables(model):
    """Variables that layers of `model` hold in attributes without Keras
    tracking them, so that `model.variables` omits them: a stateful RNN's
    `states` (`RNN._create_state_variables` makes them under
    `no_automatic_dependency_tracking`), which its `call` reads and then
    assigns. Looked for in each layer's attributes, and in lists and tuples
    there. No public way: `model.variables` omits them."""
    import keras

    known = {id(v) for v in model.variables}
    found = {}

    def walk(value):
        if isinstance(value, keras.Variable):
            if id(value) not in known:
                found.setdefault(id(value), value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    for layer in sublayers(model):
        for value in vars(layer).values():
            walk(value)
    return list(found.values())


def seed_generators(layer):
    """`SeedGenerator`s of `layer` and its sublayers (`_seed_generators`)."""
    return [generator for sub in sublayers(layer) for generator in getattr(sub, "_seed_generators", ())]


def draws_from_torch_global_generator(layer):
    """Whether `layer` or a sublayer owns a `SeedGenerator` made without a
    seed (`SeedGenerator._initial_seed`): on PyTorch, Keras's `dropout` with such a generator draws from torch's
    global generator (keras/src/backend/torch/random.py), one state that
    every such call advances in turn. No public way."""
    return any(generator._initial_seed is None for generator in seed_generators(layer))


def has_sublayers(layer):
    """Whether `layer` tracks layers of its own (`Layer._layers`).
    Public: `Model.layers`, models only."""
    return bool(layer._layers)


def set_dtype_policy(layer, policy):
    """Sets a layer's (or a Functional's) dtype policy as `Layer.__init__`
    does (`_dtype_policy`): Functional ignores `dtype=`, and the public
    setter would quantize on a quantized policy."""
    layer._dtype_policy = policy


def own_losses(layer):
    """The losses `layer` itself added in its last call
    (`Layer._get_own_losses`), not its sublayers'. Public: `layer.losses`, its sublayers' too."""
    return layer._get_own_losses()


def logits_of(tensor):
    """The logits Keras's softmax and sigmoid attach to their output
    (`_keras_logits`), from which crossentropy losses compute stably, or
    None. No public way."""
    return getattr(tensor, "_keras_logits", None)


def attach_logits(tensor, logits):
    """Attaches `logits` to `tensor` as Keras's softmax and sigmoid do,
    where the backend's tensors take attributes."""
    try:
        tensor._keras_logits = logits
    except AttributeError:  # a C-type tensor, as Keras itself allows
        pass


def walk_saveable(obj):
    """`saving_lib._walk_saveable`: the (name, value) pairs Keras saves
    for `obj` besides its weights. No public way."""
    saving_lib, _ = saving_modules()
    return saving_lib._walk_saveable(obj)


def saveable_type(obj):
    """`KerasSaveable._obj_type()`: the kind Keras records for a saved
    object ("Model", "Layer", ...)."""
    return obj._obj_type()


def jax_state(model):
    """`Model._get_jax_state`: every variable value the JAX trainer passes
    to its compiled `train_step`, as that trainer collects them.
    No public way: the trainer's own collection."""
    return model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
        purge_model_variables=False,
    )
