"""Load user code given as ``module:function`` or ``path/to/file.py:function``.

One loader for every hook (generate, reward, filter, custom loss). Plugins come from config or the
command line only, never from an HTTP request. A bad path raises ``PluginError`` naming the spec
and what was wrong (module not found, file missing, attribute missing, not callable).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable


class PluginError(ValueError):
    """A ``module:function`` spec that cannot be loaded."""


def load_plugin(spec: str, *, what: str = "plugin") -> Callable[..., Any]:
    """Return the callable named by ``spec``; ``what`` (e.g. "reward") goes into error messages."""
    if not isinstance(spec, str) or ":" not in spec:
        raise PluginError(f"{what} {spec!r}: expected 'module:function' or 'path/file.py:function'")
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise PluginError(f"{what} {spec!r}: expected 'module:function' or 'path/file.py:function'")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise PluginError(f"{what} {spec!r}: file {path} does not exist")
        mod_name = f"headrace_plugin_{abs(hash(str(path)))}"
        module = sys.modules.get(mod_name)
        if module is None:
            file_spec = importlib.util.spec_from_file_location(mod_name, path)
            if file_spec is None or file_spec.loader is None:
                raise PluginError(f"{what} {spec!r}: cannot import {path}")
            module = importlib.util.module_from_spec(file_spec)
            sys.modules[mod_name] = module
            try:
                file_spec.loader.exec_module(module)
            except Exception as e:
                sys.modules.pop(mod_name, None)
                raise PluginError(f"{what} {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            raise PluginError(f"{what} {spec!r}: module {target!r} not found ({e})") from e
        except Exception as e:
            raise PluginError(f"{what} {spec!r}: importing {target!r} failed: {type(e).__name__}: {e}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{what} {spec!r}: {target!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PluginError(f"{what} {spec!r}: {attr!r} is not callable")
    return obj
