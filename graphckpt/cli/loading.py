"""Loading a model file for the command line: one-line errors that say
what to try."""

import importlib
import os
import re
import sys
import traceback
import zipfile

from graphckpt.cli.args import CliError
from graphckpt.cli.startup import import_keras


def load_model_file(path, imports=()):
    """Loads a `.keras` file after importing `imports` (modules that register
    custom classes). Also the recipe `measure` runs in its child process."""
    keras = import_keras()
    for name in imports:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise CliError(f"--import {name}: {e}") from None
    # Not compiled: no command trains the model as saved (`measure` compiles
    # its own), and Keras's compile-on-load warnings would be noise here.
    return keras.saving.load_model(path, compile=False)


def gist(error, limit=400):
    """The gist of an error message: its first line, without the object
    config Keras appends, cut after a whole sentence (or word) so that it
    stays under about `limit` characters."""
    text = str(error).strip() or type(error).__name__
    text = text.splitlines()[0].split(" Full object config:")[0].strip()
    if len(text) <= limit:
        return text
    sentences = re.split(r"(?<=[.!?])\s+", text)
    kept = sentences[0]
    for sentence in sentences[1:]:
        if len(kept) + 1 + len(sentence) > limit:
            break
        kept += " " + sentence
    if len(kept) > limit:  # one long sentence: cut at a word
        kept = kept[:limit].rsplit(" ", 1)[0] + " ..."
    return kept


# Keras's messages when a file names a class nobody registered: the one case
# where importing the module that defines it (--import) helps.
_MISSING_CLASS = re.compile(r"Could not locate (class|function)|Could not deserialize|register_keras_serializable|custom_objects")
_MODEL_SUFFIXES = (".keras", ".h5", ".hdf5")


def _root_cause(error):
    """The exception at the bottom of `error`'s chain: Keras wraps the
    reason a nested layer did not load ("Could not locate class ...") in a
    generic "could not be deserialized properly"."""
    seen = {id(error)}
    while True:
        inner = error.__cause__ or error.__context__
        if inner is None or id(inner) in seen:
            return error
        seen.add(id(inner))
        error = inner


def _load_tip(path, error):
    """What to try when `path` did not load with `error`."""
    if not path.lower().endswith(_MODEL_SUFFIXES):
        return (
            "Tip: pass a model saved with `model.save('model.keras')` (a .keras file; legacy .h5 files load too)."
        )
    if _MISSING_CLASS.search(str(error)):
        return (
            "Tip: pass --import MODULE for each module that defines (and registers) the model's custom classes."
        )
    return "Tip: save the model with `model.save('model.keras')` and check that the file is complete."


def load(path, imports, debug):
    """The model in `path`, or a `CliError` saying why not."""
    if not os.path.exists(path):
        raise CliError(f"no such file: {path}")
    if os.path.isdir(path):
        raise CliError(f"{path} is a directory, not a .keras model file")
    if path.endswith(".keras") and not zipfile.is_zipfile(path):
        raise CliError(f"{path} is not a Keras model file: a .keras file is a zip archive, and this one is not")
    keras = import_keras()
    try:
        model = load_model_file(path, imports)
    except CliError:
        raise
    except Exception as e:
        if debug:
            traceback.print_exc()
        cause = _root_cause(e)
        reason = gist(cause)
        stop = "" if reason.endswith((".", "!", "?", "...")) else "."
        raise CliError(
            f"could not load {path} as a Keras model. {type(cause).__name__}: {reason}{stop} {_load_tip(path, cause)}"
        ) from None
    if not isinstance(model, keras.Model):
        raise CliError(f"{path} holds a {type(model).__name__}, not a Keras model")
    return model


def planned(model, planner_kwargs):
    """`(plain model, graph, plan)`: a checkpointed file keeps its own plan
    unless new planner arguments are given. The graph has the real shapes
    the plan is estimated for (`--input-shape`)."""
    import graphckpt
    from graphckpt import api
    from graphckpt.graph.shapes import plan_graph, sized_graph

    if isinstance(model, graphckpt.CheckpointedModel):
        plain = graphckpt.uncheckpoint(model)
        if not {"segments", "budget", "open_layers", "attention_chunks"} & set(planner_kwargs):
            shape = planner_kwargs.get("input_shape") or model.plan.opened_at
            graph = plan_graph(plain, model.plan)
            graph, _ = sized_graph(graph, shape, planner_kwargs.get("batch_size"))
            return plain, graph, model.plan
        model = plain
    result = api.planned(model, **planner_kwargs)
    result.warn_if_unchanged(model.name)
    return model, result.sized_graph, result.plan
