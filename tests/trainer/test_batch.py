"""Batch validation (bad input names the group) and token-budget packing (no padding, whole sequences)."""

from __future__ import annotations

import pytest

from headrace.shared.schemas import Group, Sample
from headrace.trainer.batch import BadBatchError, build_batch, micro_batches_for_rank, pack, shard_for_dp

V = 100


def group(gid: str, prompt: list[int], responses: list[list[int]], rewards=None, masks=None, failed=()) -> Group:
    samples = []
    for i, r in enumerate(responses):
        fail = i in failed
        samples.append(Sample(uid=f"{gid}-{i}", group_id=gid, index=i, tokens=prompt + r, response_length=len(r),
                              loss_mask=(masks[i] if masks else [1] * len(r)),
                              rollout_logprobs=[-0.5] * len(r),
                              reward=None if fail else (rewards[i] if rewards else float(i)),
                              status="failed" if fail else "completed"))
    return Group(group_id=gid, samples=samples)


def test_layout_of_one_sequence():
    g = group("a", [1, 2, 3], [[4, 5]], masks=[[1, 0]])
    b = build_batch([g], vocab_size=V)
    (mb,) = pack(b, [0], 100)
    assert mb.input_ids.tolist() == [1, 2, 3, 4]
    assert mb.target_ids.tolist() == [2, 3, 4, 5]
    assert mb.position_ids.tolist() == [0, 1, 2, 3]
    assert mb.cu_seqlens.tolist() == [0, 4]
    assert mb.loss_mask.tolist() == [0, 0, 1, 0]        # target 4 trained, 5 masked (tool token)
    assert mb.has_rollout.tolist() == [False, False, True, True]
    assert mb.rollout_logprobs.tolist() == [0.0, 0.0, -0.5, -0.5]


def test_packing_respects_budget_without_padding():
    gs = [group(f"g{k}", [1] * (2 + k), [[7] * (1 + (k * 3 + i) % 5) for i in range(4)]) for k in range(5)]
    b = build_batch(gs, vocab_size=V)
    mbs = pack(b, range(len(b.samples)), 16)
    seen = sorted(i for mb in mbs for i in mb.sample_ids)
    assert seen == list(range(len(b.samples)))             # each sample exactly once
    total = sum(len(s.tokens) - 1 for s in b.samples)
    assert sum(mb.num_tokens for mb in mbs) == total          # no padding anywhere
    for mb in mbs:
        assert mb.num_tokens <= 16
        lens = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()
        assert lens == [len(b.samples[i].tokens) - 1 for i in mb.sample_ids]


def test_sequence_longer_than_budget_goes_alone():
    b = build_batch([group("a", [1] * 10, [[2] * 10, [3]])], vocab_size=V)
    mbs = pack(b, [0, 1], 8)
    assert [mb.sample_ids for mb in mbs] == [[0], [1]]


def test_dp_shards_balance_tokens_and_cover_everything():
    shards = shard_for_dp([10, 9, 8, 1, 1, 1], 2)
    assert sorted(shards[0] + shards[1]) == list(range(6))
    loads = [sum([10, 9, 8, 1, 1, 1][i] for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= 10  # LPT: imbalance at most one sequence; {10,1,1,1} vs {9,8} is optimal here
    assert sorted(loads) == [13, 17]
    assert shard_for_dp([5], 3)[1:] == [[], []]


def test_failed_and_masked_samples_not_packed():
    g = group("a", [1, 2], [[3, 4], [5, 6], [7]], masks=[[1, 1], [0, 0], [1]], failed=(2,))
    b = build_batch([g], vocab_size=V)
    assert [s.failed for s in b.samples] == [False, False, True]
    mbs = micro_batches_for_rank(b, 1, 0, 100)
    assert [i for mb in mbs for i in mb.sample_ids] == [0]
    r, valid = b.rewards()
    assert valid.tolist() == [True, True, False]


@pytest.mark.parametrize("bad,match,gid", [
    (lambda: [group("g1", [1, 2], [[3]]), group("bad-vocab", [1, 2], [[3, V]])], "outside the vocabulary", "bad-vocab"),
    (lambda: [Group(group_id="mismatch", samples=[
        Sample(uid="x0", group_id="mismatch", index=0, tokens=[1, 2, 3], response_length=1, loss_mask=[1], reward=1.0),
        Sample(uid="x1", group_id="mismatch", index=1, tokens=[1, 9, 3], response_length=1, loss_mask=[1], reward=0.0)])],
     "prompt tokens differ", "mismatch"),
    (lambda: [], "empty batch", None),
    (lambda: [group("all-masked", [1, 2], [[3], [4]], masks=[[0], [0]])], "no trainable token", "all-masked"),
    (lambda: [{"group_id": "nan-reward", "samples": [{"uid": "n0", "group_id": "nan-reward", "tokens": [1, 2],
                                                       "response_length": 1, "loss_mask": [1], "reward": float("nan")}]}],
     "reward", "nan-reward"),
])
def test_bad_batches_name_the_group(bad, match, gid):
    with pytest.raises(BadBatchError, match=match) as e:
        build_batch(bad(), vocab_size=V)
    if gid is not None:
        assert gid in str(e.value)


def test_context_length_checked():
    with pytest.raises(BadBatchError, match="exceed the model's context"):
        build_batch([group("long", [1] * 10, [[2] * 10])], vocab_size=V, max_seq_len=16)
