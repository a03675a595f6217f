"""The segment layer: one sub-model, run under exact rematerialization.

In training, a `Segment` runs its sub-model through
`graphckpt.runtime.remat.segment_remat` (a custom gradient on TensorFlow, a
`custom_vjp` on JAX, a non-reentrant `torch.utils.checkpoint` on PyTorch;
`keras.remat` on any other backend), so the backward pass keeps only the
segment's inputs and recomputes its interior.
Recompute that differs from the forward pass gives wrong gradients, so:

- **Random layers and BatchNormalization.** Every non-trainable variable of
  the sub-model (seed-generator states, moving statistics, frozen weights),
  the variables its layers hold untracked (a stateful RNN's states), and
  the state of Keras's global seed generator when one exists, is
  frozen to a snapshot taken *before* the forward pass, through a
  `keras.StatelessScope`. The forward pass and its recompute read the same
  snapshot, so they draw the same random numbers. The state the forward pass
  wrote is returned from the rematerialized function and assigned once,
  outside it: moving statistics are updated exactly once per step.
- **Trainable variables** are read once, in the forward pass, and the
  recompute uses those reads, as a plain backward pass does: on TensorFlow
  they are arguments of the custom gradient, whose gradients reach the
  variables through the reads; on JAX the trainer's stateless values are
  arguments of the `custom_vjp`; on PyTorch, whose autograd runs in order,
  the recompute reads the variables. Those no live output depends on
  (behind an unused output of a nested model) are closed-over snapshots:
  the remat would give them zero gradients where the original gives None,
  which optimizers skip (no weight decay, no momentum step).
- **Layer losses** (`add_loss`, activity regularizers) are collected by the
  scope and returned as outputs of the rematerialized function, then added
  to this layer, so their gradients flow. Weight regularizers are computed
  from the variables by `Model.losses` and need nothing here.
- **Masks.** Keras attaches a mask to a tensor (`_keras_mask`), and the
  layers after read it from there. Every run of the sub-model, forward and
  recompute, starts with the masks the inputs carried when the segment was
  called, attached to its inputs (the recompute's are new tensors). The
  outputs' masks, and what the layers left of the inputs' masks (Keras's
  MultiHeadAttention removes them), are returned from the rematerialized
  function and attached to the outer tensors, as in the original, where
  they were the same tensors.
- **Logits.** A softmax or sigmoid output carries its logits
  (`_keras_logits`), from which TensorFlow's crossentropy losses compute
  the loss instead of from clipped probabilities. They are returned from the
  rematerialized function too, and attached to the output again.
- Only floating-point inputs are arguments of the rematerialized function;
  integer and boolean inputs are closed over. `training` is bound in the
  closure, never passed as a keyword (keras-team/keras#21207).

With `training` false or None the sub-model is called directly: inference
never takes the rematerialization path.
"""

import contextlib
import re
import typing
import warnings

import keras
from keras import ops

from graphckpt import errors, keras_compat
from graphckpt.graph.build import dependencies
from graphckpt.runtime import remat

__all__ = ["Segment"]


@contextlib.contextmanager
def _no_autocast():
    """Leaves any autocast scope for the duration.

    Under an autocast scope (a mixed-precision layer's call) a variable's
    `value` and `dtype` follow the scope's dtype, so a snapshot taken there,
    or a `StatelessScope` made there, would round float32 weights and state
    to float16 where the original model reads them in full (a float32
    layer in a `mixed_float16` model)."""
    saved = keras_compat.global_attribute("autocast_scope")
    keras_compat.set_global_attribute("autocast_scope", None)
    try:
        yield
    finally:
        keras_compat.set_global_attribute("autocast_scope", saved)


def _is_float(x):
    return "float" in keras.backend.standardize_dtype(x.dtype)


class _Layout(typing.NamedTuple):
    """What one run of a segment's function returns, in order: its outputs
    (`n_out`, floating ones first: `out_order`), the logits of the outputs
    `with_logits`, the masks of the outputs `masked` and of the inputs whose
    masks the layers `replaced` (`cleared`: removed), the new values of the
    state variables `updated`, and `n_losses` losses. The forward pass and
    its recompute must agree on it."""

    n_out: int
    masked: tuple
    updated: tuple
    n_losses: int
    out_order: tuple
    with_logits: tuple
    cleared: tuple
    replaced: tuple


def _global_seed_state():
    """The state of Keras's global seed generator, if one exists: layers that
    call `keras.random.*` with `seed=None` draw from it."""
    generator = keras_compat.global_attribute("global_seed_generator")
    return [generator.state] if generator is not None else []


def _outer_values(variables):
    """Values of `variables` in an enclosing StatelessScope (JAX's trainer
    runs whole steps in one), else None."""
    scope = keras_compat.enclosing_stateless_scope()
    if scope is None:
        return None
    return [scope.get_current_value(v) for v in variables]


def _check_no_lost_assignments(segment, before, after, created=()):
    """Raises if the sub-model assigned a variable the segment does not
    know of: the assignment would stay in the segment's StatelessScope and
    be lost, and training would silently differ from the original's.
    `created`: variables made during the call (Keras's global seed
    generator, made at the first unseeded random op), exempt."""
    made = {id(v) for v in created}
    lost = [key for key in after if key not in before and key not in made]
    if lost:
        raise errors.UnsupportedModelError(
            f"A layer inside segment '{segment.name}' assigned {len(lost)} variable(s) that are not among "
            "the model's variables (`model.variables`) nor held in a layer's attributes, so graphckpt "
            "cannot snapshot them for the recompute or apply the assignment once. Tip: create such "
            "state with `self.add_weight(..., trainable=False)`, or keep the layer out of recomputed "
            "segments with `policy=graphckpt.policies.save_these_layers(...)`."
        )


def _call_masked(model, inputs, training, masks):
    """`model(inputs, training=training, mask=masks)`, without the warning
    Keras gives whenever a functional model gets a mask: `Functional.call`
    attaches the masks to its inputs, and its layers apply them, but
    `Layer.__call__` then warns that the model "does not support masking"."""
    with warnings.catch_warnings():
        message = f"Layer '{re.escape(model.name)}' \\(of type \\w+\\) was passed an input with a mask"
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
        return model(inputs, training=training, mask=masks)


@keras.saving.register_keras_serializable(package="graphckpt")
class Segment(keras.layers.Layer):
    """Runs a functional sub-model with exact rematerialization in training.

    Args:
        model: a functional `keras.Model` whose inputs and outputs are flat
            lists. Its layers are used as they are, not copied.
        live_outputs: indices of the outputs the enclosing model's outputs
            depend on (default: all). Variables only the others depend on
            get no gradient from this segment, as in the original.
        **kwargs: base `Layer` arguments (`name`, ...).

    Call arguments:
        inputs: a list of tensors, one per sub-model input.
        training: rematerialize when true; call directly otherwise.
        mask: optional list of masks, one per input; where None (or
            absent), the mask the input carries.

    Returns:
        A list of tensors, one per sub-model output, with masks attached.
    """

    def __init__(self, model, live_outputs=None, **kwargs):
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        if not isinstance(model, keras.Model):
            raise errors.NotAModelError(
                f"`model` must be a keras.Model. Received: model={model!r}. "
                "Tip: `graphckpt.checkpoint_model(model)` builds the segments of a model for you."
            )
        self.model = model
        self.supports_masking = True
        keras_compat.keep_input_dtypes(self)
        self.built = True
        # Recompute counter; tests use it to prove recompute happens (eager).
        self.forward_calls = 0
        self.live_outputs = None if live_outputs is None else tuple(int(i) for i in live_outputs)

    def _unread_trainable(self):
        """Trainable variables of the sub-model that none of its live
        outputs depends on (e.g. behind an unused output of a nested model).

        Looked up at every call, never cached: `trainable` flags change
        between calls (freeze, train the head, unfreeze, recompile), and a
        variable unfrozen since must get its gradient again."""
        read = {id(v) for v in dependencies(self.model, self.live_outputs)[1]}
        return [v for v in self.model.trainable_variables if id(v) not in read]

    def call(self, inputs, training=None, mask=None):
        inputs = list(inputs)
        masks = list(mask) if mask is not None else [None] * len(inputs)
        # Where no mask is given, the one the input carries: Keras attaches
        # masks to tensors, and the layers inside read them from there, as
        # they did in the original model. The rewrite passes none (see
        # `graphckpt.runtime.rewrite`), so each call reads what its inputs carry
        # when it runs.
        masks = [keras_compat.get_keras_mask(x) if m is None else m for x, m in zip(inputs, masks)]
        if not training:
            outputs = _call_masked(self.model, inputs, training, masks)
            return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        return self._remat_call(inputs, masks)

    def _remat_call(self, inputs, masks):
        model = self.model
        state = [v for v in model.variables if not v.trainable]
        state += keras_compat.untracked_variables(model)  # a stateful RNN's states
        generator = _global_seed_state()
        state += [v for v in generator if all(v is not s for s in state)]
        trainable = [v for v in model.variables if v.trainable]
        with _no_autocast():
            snapshot = [remat.snapshot(v) for v in state]
        backend = keras.backend.backend()
        # `closed`: (variable, value) pairs the function closes over;
        # `passed`: those whose values are its arguments, after the inputs.
        closed = list(zip(state, snapshot))
        passed = []
        # Under an enclosing StatelessScope, trainable values live there.
        outer = _outer_values(trainable)
        if outer is not None:
            passed = [(v, x) for v, x in zip(trainable, outer) if x is not None]
        else:
            # The backend's remat gives every variable the function reads a
            # gradient, zeros where none flows; the original gives None, and
            # optimizers skip None (no weight decay, no momentum step). So
            # variables no output depends on are read as snapshots instead.
            unread = self._unread_trainable()
            with _no_autocast():
                closed += [(v, remat.snapshot(v)) for v in unread]
                if backend == "tensorflow":
                    # Read once, here; the recompute reuses the reads (see
                    # `remat.tf_remat`), and their gradients reach the variables.
                    unread_ids = {id(v) for v in unread}
                    passed = [(v, remat.snapshot(v)) for v in trainable if id(v) not in unread_ids]
        if backend == "jax":
            # Everything is an argument, so that `remat.jax_remat` ties the
            # inputs to the cotangents (integer ones too: an Embedding's
            # ids) and no differentiated value is closed over.
            closed, passed = [], closed + passed
        mapping = closed + passed
        # A sparse input enters as its component tensors (values, indices,
        # shape): the float ones are arguments, so gradients reach them.
        parts, packs = [], []
        for x in inputs:
            components, pack = remat.components(x)
            packs.append((len(parts), len(components), pack))
            parts += components
        float_idx = [i for i, x in enumerate(parts) if backend == "jax" or _is_float(x)]
        layout = {}

        def forward(*args, tie=list):
            # `tie`: in TensorFlow's recompute, ties what is closed over to
            # the incoming gradients (see `remat.segment_remat`).
            self.forward_calls += 1
            ps = list(parts)
            other_idx = [i for i in range(len(ps)) if i not in float_idx]
            for i, x in zip(other_idx, tie([ps[i] for i in other_idx])):
                ps[i] = x
            for i, x in zip(float_idx, args):
                ps[i] = x
            xs = [pack(ps[start : start + n]) for start, n, pack in packs]
            # The masks this run starts from, attached to its inputs: the
            # recompute's inputs are new tensors (on PyTorch, the forward
            # pass's own, which later layers may have changed the masks of).
            ms = tie(masks)
            for x, m in zip(xs, ms):
                keras_compat.set_keras_mask(x, m)
            values = tie([x for _, x in closed]) + list(args[len(float_idx) :])
            with _no_autocast():
                scope = keras.StatelessScope(
                    state_mapping=[(v, x) for (v, _), x in zip(mapping, values)], collect_losses=True
                )
            with scope:
                before = dict(scope.state_mapping)
                with keras_compat.freeing_dead_tensors(model):
                    outs = _call_masked(model, xs, True, ms)
                outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
                out_masks = [keras_compat.get_keras_mask(o) for o in outs]
                # Layers change the masks of their inputs too (Keras's
                # MultiHeadAttention removes them, a nested model's call
                # sets them), and later layers outside read what is left.
                in_masks = [keras_compat.get_keras_mask(x) for x in xs]
                changed = tuple(i for i, (m, after) in enumerate(zip(ms, in_masks)) if after is not m)
                out_logits = [keras_compat.logits_of(o) for o in outs]
                updated = [
                    i
                    for i, v in enumerate(state)
                    if scope.state_mapping.get(id(v)) is not before.get(id(v))
                ]
                _check_no_lost_assignments(self, before, scope.state_mapping, _global_seed_state())
                new_state = [ops.stop_gradient(scope.get_current_value(state[i])) for i in updated]
                losses = list(scope.losses)
                # The layers inside keep the ids of these losses (Keras's
                # `_loss_ids`) until their next call clears them; by then
                # the losses are freed and a new tensor may have the same
                # id, which that clear would then drop from the scope of a
                # later, unrelated call. Forget them now.
                keras_compat.clear_losses(model)
            found = _Layout(
                n_out=len(outs),
                masked=tuple(i for i, m in enumerate(out_masks) if m is not None),
                updated=tuple(updated),
                n_losses=len(losses),
                # Floating outputs first: in graph mode `tf.recompute_grad`
                # reads the gradient of the *first* result, which must not be
                # the (absent) gradient of a boolean or integer output.
                out_order=tuple(sorted(range(len(outs)), key=lambda i: not _is_float(outs[i]))),
                # Softmax and sigmoid outputs carry their logits, which
                # crossentropy losses read instead of clipped probabilities.
                with_logits=tuple(i for i, x in enumerate(out_logits) if x is not None),
                # Inputs whose masks the layers removed, and replaced.
                cleared=tuple(i for i in changed if in_masks[i] is None),
                replaced=tuple(i for i in changed if in_masks[i] is not None),
            )
            if layout.setdefault("found", found) != found:
                raise RuntimeError(
                    f"Segment '{self.name}' recomputed a different structure "
                    f"than its forward pass ({found} vs {layout['found']})."
                )
            # Masks travel as floats: no gradient, no bool arithmetic in remat.
            float_masks = [ops.cast(out_masks[i], "float32") for i in found.masked]
            float_masks += [ops.cast(in_masks[i], "float32") for i in found.replaced]
            logits = [out_logits[i] for i in found.with_logits]
            return tuple([outs[i] for i in found.out_order] + logits + float_masks + new_state + losses)

        args = [parts[i] for i in float_idx]
        results = list(remat.segment_remat(forward, len(args))(*args, *[x for _, x in passed]))
        if not generator and _global_seed_state():
            # Keras made its global seed generator in this call, at the
            # segment's first unseeded random op, so it is not in the
            # snapshot: the forward pass advanced it only inside its scope,
            # and the recompute would read it afresh. Its state is still the
            # initial one the forward pass drew from: run again with it in
            # the snapshot, as every later call does (the results above are
            # dropped; nothing of them was assigned).
            return self._remat_call(inputs, masks)
        n_out, masked, updated, n_losses, out_order, with_logits, cleared, replaced = layout["found"]
        outs = [None] * n_out
        for i, x in zip(out_order, results[:n_out]):
            outs[i] = x
        rest = results[n_out:]
        for i, x in zip(with_logits, rest[: len(with_logits)]):
            keras_compat.attach_logits(outs[i], x)
        rest = rest[len(with_logits) :]
        for i, m in zip(masked, rest[: len(masked)]):
            keras_compat.set_keras_mask(outs[i], ops.cast(m, "bool"))
        rest = rest[len(masked) :]
        # What the layers did to the masks of the inputs, the outer tensors
        # show too, as in the original model, where they were the same
        # tensors (the forward pass may have run on others: JAX traces it).
        for i in cleared:
            keras_compat.set_keras_mask(inputs[i], None)
        for i, m in zip(replaced, rest[: len(replaced)]):
            keras_compat.set_keras_mask(inputs[i], ops.cast(m, "bool"))
        rest = rest[len(replaced) :]
        for i, value in zip(updated, rest[: len(updated)]):
            state[i].assign(value)
        losses = rest[len(updated) :]
        for loss in losses:
            self.add_loss(loss)
        # Keras forgets a layer's loss ids only at its next call, when it
        # also drops every loss of the current scope whose id is among
        # them. Holding the losses keeps those ids from being reused by
        # another layer's new loss in the meantime (a dropped loss: a CI
        # run on JAX lost one).
        self.__dict__["_graphckpt_losses"] = tuple(losses)
        return outs

    def compute_output_spec(self, inputs, training=None, mask=None):
        spec = self.model.compute_output_spec(list(inputs))
        return list(spec) if isinstance(spec, (list, tuple)) else [spec]

    def compute_mask(self, inputs, mask=None):
        return None  # `call` attaches the output masks itself.

    def get_config(self):
        config = super().get_config()
        config["model"] = keras.saving.serialize_keras_object(self.model)
        config["live_outputs"] = None if self.live_outputs is None else list(self.live_outputs)
        return config

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(config["model"])
        return cls(**config)
