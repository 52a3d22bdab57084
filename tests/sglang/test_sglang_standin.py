"""The test-only ``sgl_kernel`` CPU stand-in (tests/sglang/sglang_cpu) against the semantics of the
SGLang 0.5.23 Triton kernels it replaces (read in sglang/srt/mem_cache/allocation.py and
sglang/kernels/ops/kvcache/cache_move.py). End to end it is exercised by every test that runs
the real server (tests/sglang/test_sglang_contract.py)."""

from __future__ import annotations

import pytest
import torch

from tests.sglang.sglang_cpu import sgl_kernel

pytestmark = pytest.mark.sglang


def test_assign_req_to_token_pool_writes_each_requests_slice_of_out_cache_loc() -> None:
    req_to_token = torch.full((4, 10), -1, dtype=torch.int32)
    req_pool_indices = torch.tensor([2, 0, 3])
    start = torch.tensor([0, 5, 2])
    end = torch.tensor([3, 7, 2])       # the third request adds nothing
    out_cache_loc = torch.tensor([100, 101, 102, 200, 201], dtype=torch.int64)
    sgl_kernel.assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start, end, out_cache_loc, 10)
    assert req_to_token[2, :3].tolist() == [100, 101, 102]
    assert req_to_token[0, 5:7].tolist() == [200, 201]
    assert int((req_to_token != -1).sum()) == 5
    with pytest.raises(ValueError, match="pool_len"):
        sgl_kernel.assign_req_to_token_pool_cpu(torch.tensor([1]), req_to_token, torch.tensor([8]),
                                                torch.tensor([12]), out_cache_loc, 10)


def test_copy_all_layer_kv_cache_reads_all_sources_before_writing() -> None:
    layers = [torch.arange(6 * 4, dtype=torch.float32).view(6, 4).clone() for _ in range(2)]
    layers.append(torch.arange(6 * 2, dtype=torch.float16).view(6, 2).clone())
    before = [t.clone() for t in layers]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers], dtype=torch.int64)
    src, tgt = torch.tensor([1, 2, 5]), torch.tensor([2, 4, 1])   # row 2 is both read and written
    sgl_kernel.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for t, b in zip(layers, before):
        expect = b.clone()
        expect[tgt] = b[src]
        assert torch.equal(t, expect)


def test_speculative_helpers_say_they_are_not_provided() -> None:
    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu.*speculative decoding"):
        sgl_kernel.verify_tree_greedy_cpu()
    assert sgl_kernel.IS_HEADRACE_STANDIN
    assert not hasattr(torch.ops.sgl_kernel, "decode_attention_cpu")  # no fused CPU ops registered
