"""TEST-ONLY pure-torch stand-in for the CPU functions SGLang 0.5.23 imports from ``sgl_kernel``.

This is not SGLang's kernel package. It exists so the real SGLang server can run in Headrace's
``sglang`` test tier on machines without a GPU (the CPU build of the kernel package is not on
PyPI). ``scripts/build_sglang_venv.sh`` installs it into the test venv only; it must never be
installed on a GPU deployment, where the real ``sglang-kernel`` wheel provides this module.

Guarantees:
- ``assign_req_to_token_pool_cpu`` — the only function plain (non-speculative) decoding calls —
  has the semantics of SGLang's Triton kernel ``assign_req_to_token_pool``.
- ``copy_all_layer_kv_cache_cpu`` copies KV rows between slots of every layer buffer.
- The speculative-decoding helpers are imported by SGLang at module load; the simple ones are
  implemented, the tree-building / tree-verifying ones raise ``NotImplementedError`` naming the
  missing function (our tests never enable speculative decoding).
- No ``torch.ops.sgl_kernel`` operator is registered: SGLang probes for those before using its
  fused CPU kernels, so it stays on its native-torch paths.
"""

from __future__ import annotations

import ctypes

import torch

__version__ = "0.5.23+headrace.cpu.standin"
IS_HEADRACE_STANDIN = True


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For request i, write its slice of ``out_cache_loc`` into its row of ``req_to_token``.

    Request i owns ``end_offset[i] - start_offset[i]`` consecutive entries of ``out_cache_loc``
    (requests laid out one after the other); they go to
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``.
    ``pool_len`` is the row length of ``req_to_token`` (bounds check only).
    """
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    pos = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n <= 0:
            continue
        if end > pool_len:
            raise ValueError(f"assign_req_to_token_pool_cpu: end offset {end} exceeds pool_len {pool_len}")
        req_to_token[row, start:end] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """For each layer buffer (base address ``data_ptrs[l]``, row size ``strides[l]`` bytes), copy
    row ``src_loc[j]`` to row ``tgt_loc[j]`` for every j. Like the Triton kernel, every source
    row is read before any target row is written, so overlapping src/tgt sets are safe.
    """
    if src_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for base, nbytes in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * nbytes)).from_address(base)
        table = torch.frombuffer(raw, dtype=torch.uint8).view(rows, nbytes)
        table[tgt] = table[src].clone()


def rotate_input_ids_cpu(*args, **kwargs):
    raise NotImplementedError(_SPEC_MSG.format("rotate_input_ids_cpu"))


def fill_accept_out_cache_loc_cpu(*args, **kwargs):
    raise NotImplementedError(_SPEC_MSG.format("fill_accept_out_cache_loc_cpu"))


def fill_bonus_tokens_cpu(*args, **kwargs):
    raise NotImplementedError(_SPEC_MSG.format("fill_bonus_tokens_cpu"))


def assign_draft_cache_locs_contiguous_cpu(*args, **kwargs):
    raise NotImplementedError(_SPEC_MSG.format("assign_draft_cache_locs_contiguous_cpu"))


def assign_extend_cache_locs_cpu(*args, **kwargs):
    raise NotImplementedError(_SPEC_MSG.format("assign_extend_cache_locs_cpu"))


def build_tree_kernel_efficient_cpu(*args, **kwargs):
    raise NotImplementedError(_SPEC_MSG.format("build_tree_kernel_efficient_cpu"))


def verify_tree_greedy_cpu(*args, **kwargs):
    raise NotImplementedError(_SPEC_MSG.format("verify_tree_greedy_cpu"))


def build_draft_decode_metadata_cpu(*args, **kwargs):
    raise NotImplementedError(_SPEC_MSG.format("build_draft_decode_metadata_cpu"))


_SPEC_MSG = ("sgl_kernel.{} is not provided by Headrace's test-only CPU stand-in: speculative "
             "decoding is not supported in the CPU test tier")
