"""Buckets of weight tensors for weight sync: dtype names as SGLang spells them, bucket planning,
and the flat (``flattened_bucket``) packing and its inverse. Pure tensor code, no process groups.

Guarantees:
- ``plan_buckets`` keeps the given order within a dtype, never mixes dtypes in a bucket, never
  exceeds ``bucket_bytes`` unless one tensor alone does, and refuses a name seen twice;
- ``unflatten_bucket(flatten_bucket(b), names, shapes)`` gives views equal to ``b``'s tensors, in
  ``names`` order, the layout SGLang's receiver allocates for ``load_format="flattened_bucket"``;
- ``contiguous_run(ts)`` is that flat tensor without a copy (a view of the tensors' own storage)
  exactly when the tensors already lie back to back in one storage, in order; else None.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Sequence

import torch

__all__ = ["dtype_name", "parse_dtype", "plan_buckets", "flatten_bucket", "unflatten_bucket", "contiguous_run"]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the form SGLang resolves with ``getattr(torch, name)``)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` or ``"torch.bfloat16"`` -> ``torch.bfloat16``; ValueError names a bad one."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


def plan_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into buckets of one dtype and at most ``bucket_bytes`` (a larger tensor is
    alone in its bucket). Order is kept within a dtype; a full bucket is yielded as soon as it is
    full, the rest at the end. Lazy: tensors are pulled from the iterable as buckets fill."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    open_: dict[torch.dtype, tuple[list[tuple[str, torch.Tensor]], int]] = {}
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice in one update")
        seen.add(name)
        size = tensor.numel() * tensor.element_size()
        items, used = open_.get(tensor.dtype, ([], 0))
        if items and used + size > bucket_bytes:
            yield items
            items, used = [], 0
        items.append((name, tensor))
        open_[tensor.dtype] = (items, used + size)
    for items, _ in open_.values():
        if items:
            yield items


def flatten_bucket(bucket: Sequence[tuple[str, torch.Tensor]], device: torch.device | str = "cpu",
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """One 1-D tensor: the bucket's tensors flattened and concatenated in order, on ``device``.
    A lone tensor is returned as a flat view when it is already there; otherwise the result is
    written into the front of ``out`` when given (1-D, same dtype and device, large enough)."""
    dtypes = {t.dtype for _, t in bucket}
    if len(dtypes) != 1:
        raise ValueError(f"a flat bucket holds one dtype, got {sorted(map(dtype_name, dtypes))}")
    parts = [t.detach().reshape(-1).to(device) for _, t in bucket]
    if len(parts) == 1:
        return parts[0].contiguous()
    n = sum(p.numel() for p in parts)
    if out is None:
        return torch.cat(parts)
    if out.dim() != 1 or out.dtype != parts[0].dtype or out.device != parts[0].device or out.numel() < n:
        raise ValueError("flatten_bucket: out must be a 1-D tensor of the bucket's dtype and device, large enough")
    return torch.cat(parts, out=out[:n])


def contiguous_run(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D view covering ``tensors`` when they are non-empty, contiguous, of one dtype and device
    and back to back in one storage in the given order: their flattened concatenation, with no copy
    (writing into it writes into them). None otherwise."""
    if not tensors:
        return None
    first = tensors[0]
    storage, end, total = first.untyped_storage().data_ptr(), first.data_ptr(), 0
    for t in tensors:
        if (t.numel() == 0 or not t.is_contiguous() or t.dtype != first.dtype or t.device != first.device
                or t.data_ptr() != end or t.untyped_storage().data_ptr() != storage):
            return None
        end += t.numel() * t.element_size()
        total += t.numel()
    return first.detach().as_strided((total,), (1,), first.storage_offset())


def unflatten_bucket(flat: torch.Tensor, names: Sequence[str],
                     shapes: Sequence[Sequence[int]]) -> list[tuple[str, torch.Tensor]]:
    """Views of ``flat`` with the given names and shapes, in order (the inverse of flatten_bucket)."""
    out, start = [], 0
    for name, shape in zip(names, shapes):
        n = 1
        for d in shape:
            n *= int(d)
        out.append((name, flat[start:start + n].view(*shape)))
        start += n
    if start != flat.numel():
        raise ValueError(f"bucket shapes cover {start} elements, the flat tensor has {flat.numel()}")
    return out
