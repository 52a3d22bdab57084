"""Dynamic-sampling group filters: ``def keep_group(ctx, group) -> bool``.

Built-ins, by name in ``rollout.filter``:
- ``zero_variance`` (alias ``nonzero_std``): drop a group whose rewards are all equal (GRPO gets no
  signal from it; DAPO's dynamic sampling). Failed samples are ignored; a group with fewer than two
  scored samples is dropped.

``apply_filter`` never raises: a filter that raises or returns something other than a bool is
logged and the group is kept (losing data silently would be worse than training on it).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Callable

from headrace.shared.plugins import load_plugin
from headrace.shared.schemas import Group

if TYPE_CHECKING:
    from headrace.rollout.generate import RolloutContext

FilterFn = Callable[["RolloutContext", Group], bool]


def zero_variance(ctx: "RolloutContext", group: Group) -> bool:
    """Keep a group only if its scored samples do not all share one reward."""
    rewards = [s.reward for s in group.samples if s.reward is not None]
    return len(rewards) >= 2 and max(rewards) > min(rewards)


BUILTIN_FILTERS: dict[str, FilterFn] = {"zero_variance": zero_variance, "nonzero_std": zero_variance}


def load_filter(spec: str | None) -> FilterFn | None:
    """A built-in filter by name, a ``module:function`` plugin, or None (keep everything)."""
    if spec is None:
        return None
    if spec in BUILTIN_FILTERS:
        return BUILTIN_FILTERS[spec]
    if ":" not in spec:
        raise ValueError(f"rollout.filter {spec!r}: not a built-in ({', '.join(BUILTIN_FILTERS)}) "
                         "and not a module:function path")
    fn = load_plugin(spec, what="filter")
    if inspect.iscoroutinefunction(fn):
        raise ValueError(f"rollout.filter {spec!r}: keep_group must be a plain function returning bool, not async")
    return fn


def apply_filter(fn: FilterFn | None, ctx: "RolloutContext", group: Group) -> tuple[bool, str | None]:
    """(keep, error): whether the group goes to the buffer, and why the filter failed if it did."""
    if fn is None:
        return True, None
    try:
        keep = fn(ctx, group)
    except Exception as e:  # noqa: BLE001 - a filter fault keeps the group
        msg = f"filter raised {type(e).__name__}: {e}"
        ctx.logger.warning("group %s: %s; keeping the group", group.group_id, msg)
        return True, msg
    if not isinstance(keep, bool):
        msg = f"filter returned {type(keep).__name__}, expected bool"
        ctx.logger.warning("group %s: %s; keeping the group", group.group_id, msg)
        return True, msg
    return keep, None
