"""A shortcut past the ``openai`` SDK's params transform for plain calls, installed by in-service agents.

Before every ``chat.completions.create`` and ``completions.create`` the SDK hands the call's params
to ``async_maybe_transform``: a walk of the data against the params' TypedDict annotations that
renames keys declared with an alias and re-formats values declared with a format (dates, base64
files). It re-derives every type on every call: each message is checked against every member of the
message union, and hashing those typing objects dominates. For one short message that costs
~0.26 ms of CPU, the largest single piece of an in-service agent's call (a third of the SDK's time
per call; bench/agent_gateway_bench.py), paid in the rollout service's event loop.

For the chat and text completion params of the SDKs we support, no annotation in the whole tree
declares an alias or a format, so for plain JSON data the walk changes nothing: its answer is the
params minus the arguments the caller left out (``NOT_GIVEN`` / ``omit``). ``plain_params`` answers
exactly that when it can prove it, and ``install`` puts it in front of the SDK's function.

Guarantees:
- The shortcut answers only when both hold; otherwise the SDK's own function runs, unchanged:
  (a) the params type's annotation tree has no ``PropertyInfo`` with an alias or a format and
  every annotation in it could be resolved (decided once per type, by ``_declares_nothing``);
  (b) the data is a ``dict`` whose values are plain JSON (``dict`` with ``str`` keys, ``list``,
  ``str``, ``int``, ``float``, ``bool``, ``None``), where only top-level values may be left out.
  Tuples, generators, pydantic models, dates, files and nested ``NOT_GIVEN`` all go to the SDK.
- Its answer equals the SDK's (tests/rollout/test_gateway_sdk_params.py compares them on the
  shapes agents send, and checks that everything else is passed through).
- ``install`` is idempotent and touches only the SDK's chat and text completion resource modules;
  an SDK without them (or without ``async_maybe_transform`` there) is left as it is. It runs in the
  process that runs in-service agents (the rollout service), where it serves any ``AsyncOpenAI``.
"""

from __future__ import annotations

import functools
import logging
import typing
from typing import Any, Awaitable, Callable

log = logging.getLogger("headrace.rollout.gateway")

_PLAIN_LEAVES = (str, int, float, bool, type(None))
_MODULES = ("openai.resources.chat.completions.completions", "openai.resources.completions")
_NAME = "async_maybe_transform"
_INSTALLED = "__headrace_plain_params__"


def _is_plain(value: Any) -> bool:
    """JSON data the SDK's walk leaves as it is: dicts with str keys, lists and scalars, exactly."""
    kind = type(value)
    if kind in _PLAIN_LEAVES:
        return True
    if kind is list:
        return all(_is_plain(v) for v in value)
    if kind is dict:
        return all(type(k) is str and _is_plain(v) for k, v in value.items())
    return False


@functools.lru_cache(maxsize=64)
def _declares_nothing(params_type: Any) -> bool:
    """True when no annotation under ``params_type`` carries a ``PropertyInfo`` alias or format and
    every TypedDict's hints resolve; False (the SDK's walk decides) on anything unexpected."""
    try:
        from openai._types import NotGiven, Omit  # noqa: F401 - what ``plain_params`` needs
        from openai._utils._transform import PropertyInfo
        from openai._utils._transform import get_type_hints as sdk_hints
        import typing_extensions
    except ImportError:
        return False
    seen: set[int] = set()
    todo = [params_type]
    try:
        while todo:
            t = todo.pop()
            if id(t) in seen:
                continue
            seen.add(id(t))
            if isinstance(t, (str, typing.ForwardRef)):
                return False   # an annotation the SDK would resolve differently: leave it to the SDK
            metadata = getattr(t, "__metadata__", None)
            if metadata is not None:   # Annotated[T, ...]
                if any(isinstance(m, PropertyInfo) and (m.alias is not None or m.format is not None)
                       for m in metadata):
                    return False
                todo.append(typing.get_args(t)[0])
                continue
            if typing.get_origin(t) in (typing.Literal, typing_extensions.Literal):
                continue   # its arguments are values, not types
            if typing_extensions.is_typeddict(t):
                todo.extend(sdk_hints(t, include_extras=True).values())
                continue
            todo.extend(typing.get_args(t))
    except Exception:   # noqa: BLE001 - any surprise in the annotations: the SDK's own walk decides
        log.debug("openai params type %r: not provably plain", params_type, exc_info=True)
        return False
    return True


def plain_params(data: Any, params_type: Any) -> dict[str, Any] | None:
    """What the SDK's transform would answer for ``data`` against ``params_type``, or None when that
    is not provably ``data`` minus its left-out top-level values."""
    if type(data) is not dict or not _declares_nothing(params_type):
        return None
    from openai._types import NotGiven, Omit   # (``_declares_nothing`` proved the SDK importable)

    out: dict[str, Any] = {}
    for key, value in data.items():
        if type(key) is not str:
            return None
        if _is_plain(value):
            out[key] = value
        elif not isinstance(value, (NotGiven, Omit)):   # what the SDK's ``is_given`` tells apart
            return None
    return out


def _shortcut(sdk: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    async def maybe_transform(data: Any, expected_type: Any) -> Any:
        out = plain_params(data, expected_type)
        return out if out is not None else await sdk(data, expected_type)

    setattr(maybe_transform, _INSTALLED, sdk)
    return maybe_transform


def install() -> bool:
    """Put ``plain_params`` in front of the SDK's transform in its chat and text completion
    resources. Returns whether it is in place in both (already installed counts)."""
    import importlib

    done = 0
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        sdk = getattr(module, _NAME, None)
        if sdk is None:
            continue
        if not hasattr(sdk, _INSTALLED):
            setattr(module, _NAME, _shortcut(sdk))
        done += 1
    return done == len(_MODULES)
