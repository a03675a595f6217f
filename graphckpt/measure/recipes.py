"""Recipes: how a child process finds the model, method and data to run.

A recipe is `"package.module:function"`, `"path/to/file.py:function"`, a
module-level function (turned into one of those), or, for a model,
`"path/to/model.keras"`."""

import importlib
import importlib.util
import os
import sys


def recipe_of(obj, what):
    """A callable or recipe string -> a recipe string the child can load."""
    if isinstance(obj, (str, os.PathLike)):
        s = os.fspath(obj)
        if what == "builder" and s.endswith(".keras"):
            return os.path.abspath(s)
        if ":" not in s:
            raise ValueError(
                f"`{what}` must be 'module:function', 'file.py:function'"
                + (", a '.keras' path" if what == "builder" else "")
                + f" or a module-level function. Received: {what}={s!r}"
            )
        target, _, name = s.rpartition(":")
        if target.endswith(".py"):
            target = os.path.abspath(target)
        return f"{target}:{name}"
    if callable(obj):
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
        if module is None or "<" in qualname:
            raise ValueError(
                f"`{what}` must be importable by the child process: a "
                f"module-level function. Received: {what}={obj!r}. Tip: define "
                "it at the top level of a module, or pass 'module:function'."
            )
        if module == "__main__":
            path = getattr(sys.modules["__main__"], "__file__", None)
            if not path:
                raise ValueError(
                    f"`{what}`={obj!r} lives in an interactive `__main__` the "
                    "child cannot import. Tip: move it into a module file."
                )
            module = os.path.abspath(path)
        return f"{module}:{qualname}"
    raise TypeError(f"`{what}` must be a string recipe or a function. Received: {what}={obj!r}")


def load(recipe):
    """Recipe string -> the callable it names (in the child)."""
    target, _, name = recipe.rpartition(":")
    if target.endswith(".py"):
        mod_name = "_graphckpt_recipe_" + os.path.splitext(os.path.basename(target))[0]
        spec = importlib.util.spec_from_file_location(mod_name, target)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    obj = module
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj
