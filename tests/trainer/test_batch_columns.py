"""The trainer's column path (``build_batch_columns``) against the row path (``build_batch``): the
same groups give the same batch and micro-batches bit for bit, and the same errors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from headrace.shared import columns as C
from headrace.shared.schemas import Group, Sample
from headrace.trainer.batch import BadBatchError, build_batch, micro_batches_for_rank, pack
from headrace.trainer.batch_columns import build_batch_columns

V = 1000
TENSORS = ("input_ids", "position_ids", "cu_seqlens", "target_ids", "loss_mask", "seq_index", "rollout_logprobs",
           "has_rollout")


def make_groups(seed: int, n_groups: int = 6) -> list[Group]:
    """Groups with shuffled indexes, failed samples, samples without logprobs, masked tool tokens."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        gid = f"g{seed}-{g}"
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 9))]
        samples = []
        for i in rng.sample(range(5), 5):   # sent out of index order
            resp = [rng.randrange(V) for _ in range(rng.randrange(0, 12))]
            failed = rng.random() < 0.15
            logprobs = None if rng.random() < 0.3 else [-rng.random() * 3 - 1e-9 for _ in resp]
            samples.append(Sample(uid=f"{gid}/{i}", group_id=gid, index=i, tokens=prompt + resp,
                                  response_length=len(resp), loss_mask=[int(rng.random() < 0.8) for _ in resp],
                                  rollout_logprobs=logprobs, reward=None if failed else rng.choice([0.0, 1.0, 0.5]),
                                  status="failed" if failed else "completed", weight_version=rng.randrange(4)))
        groups.append(Group(group_id=gid, samples=samples))
    return groups


def via_columns(groups: list[Group]) -> C.Columns:
    """What the trainer leases: the groups encoded as columns and decoded (validated) again."""
    cols, _ = C.decode(C.encode(groups))
    return cols


def float32_logprobs(groups: list[Group]) -> list[Group]:
    """Logprobs travel as float32 in columns: the rows hold the same values, so both paths see them."""
    out = []
    for g in groups:
        out.append(g.model_copy(update={"samples": [s.model_copy(update={"rollout_logprobs": None if s.rollout_logprobs
                   is None else np.float32(s.rollout_logprobs).tolist()}) for s in g.samples]}))
    return out


def assert_same(a, b) -> None:
    for name in ("group_ids", "group_sizes", "uids"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("tokens", "token_offsets", "prompt_lens", "loss_mask", "rollout_logprobs", "has_logprobs",
                 "weight_version", "trained_tokens", "response_offsets"):
        x, y = np.asarray(getattr(a, name)), np.asarray(getattr(b, name))
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name
    assert np.array_equal(a.reward, b.reward, equal_nan=True)
    for x, y in zip(a.rewards(), b.rewards()):
        assert x.dtype == y.dtype and torch.equal(x, y)
    for sa, sb in zip(a.samples, b.samples):
        assert (sa.uid, sa.group_id, sa.prompt_len, sa.reward, sa.weight_version, sa.failed, sa.trained_tokens) == \
               (sb.uid, sb.group_id, sb.prompt_len, sb.reward, sb.weight_version, sb.failed, sb.trained_tokens)


def assert_same_micro_batches(ma, mb) -> None:
    assert len(ma) == len(mb)
    for x, y in zip(ma, mb):
        assert x.sample_ids == y.sample_ids
        for name in TENSORS:
            tx, ty = getattr(x, name), getattr(y, name)
            assert tx.dtype == ty.dtype and torch.equal(tx, ty), name


def reference_pack(batch, ids: list[int]) -> dict[str, list]:
    """The layout of the module docstring, sample by sample in plain Python."""
    out: dict[str, list] = {k: [] for k in TENSORS}
    out["cu_seqlens"] = [0]
    for k, i in enumerate(ids):
        s = batch.samples[i]
        t = s.tokens.tolist()
        n, head = len(t) - 1, s.prompt_len - 1
        out["input_ids"] += t[:-1]
        out["target_ids"] += t[1:]
        out["position_ids"] += list(range(n))
        out["seq_index"] += [k] * n
        out["loss_mask"] += [0.0] * head + s.loss_mask.tolist()
        lp = s.rollout_logprobs
        out["rollout_logprobs"] += [0.0] * n if lp is None else [0.0] * head + lp.tolist()
        out["has_rollout"] += [False] * n if lp is None else [False] * head + [True] * len(lp)
        out["cu_seqlens"].append(out["cu_seqlens"][-1] + n)
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_columns_and_rows_build_the_same_batch_bit_for_bit(seed):
    groups = float32_logprobs(make_groups(seed))
    rows = build_batch(groups, vocab_size=V)
    cols = build_batch_columns(via_columns(groups), vocab_size=V)
    assert_same(rows, cols)
    for dp in (1, 2):
        for rank in range(dp):
            assert_same_micro_batches(micro_batches_for_rank(rows, dp, rank, 24),
                                      micro_batches_for_rank(cols, dp, rank, 24))
    assert_same(rows.subset(slice(1, 4)), cols.subset(slice(1, 4)))
    # the broadcast to the other ranks pickles the batch: it arrives the same
    import pickle
    assert_same(pickle.loads(pickle.dumps(cols)), rows)
    for mb in pack(cols, range(cols.num_samples), 30):
        ref = reference_pack(cols, mb.sample_ids)
        for name in TENSORS:
            assert getattr(mb, name).tolist() == ref[name], name


def test_columns_sent_in_index_order_are_views_not_copies():
    groups = make_groups(4)
    for g in groups:
        g.samples.sort(key=lambda s: s.index)
    cols = via_columns(groups)
    b = build_batch_columns(cols, vocab_size=V)
    assert np.shares_memory(b.tokens, cols.tokens) and np.shares_memory(b.loss_mask, cols.loss_mask)


def _sample(gid, i, tokens, rl, reward=1.0, status="completed"):
    return Sample(uid=f"{gid}/{i}", group_id=gid, index=i, tokens=tokens, response_length=rl, loss_mask=[1] * rl,
                  reward=reward, status=status)


@pytest.mark.parametrize("bad", [
    [Group(group_id="vocab", samples=[_sample("vocab", 0, [1, 2, 3], 1), _sample("vocab", 1, [1, 2, V], 1)])],
    [Group(group_id="prompt", samples=[_sample("prompt", 1, [1, 2, 3], 1), _sample("prompt", 0, [1, 9, 3], 1)])],
    [Group(group_id="plen", samples=[_sample("plen", 0, [1, 2, 3], 1), _sample("plen", 1, [1, 2, 3], 2)])],
    [Group(group_id="empty", samples=[_sample("empty", 0, [1, 2], 2)])],
    [Group(group_id="long", samples=[_sample("long", 0, list(range(1, 40)), 3)])],
    [Group(group_id="masked", samples=[_sample("masked", 0, [1, 2], 0)])],
    [Group(group_id="ok", samples=[_sample("ok", 0, [1, 2, 3], 1)]),
     Group(group_id="two-bad", samples=[_sample("two-bad", 0, [V + 5, 2, 3], 1), _sample("two-bad", 1, [1, 2], 2)]),
     Group(group_id="bad-too", samples=[_sample("bad-too", 0, [4, 2, 3], 1), _sample("bad-too", 1, [5, 2, 3], 1)])],
])
def test_bad_batches_give_the_same_error_both_ways(bad):
    with pytest.raises(BadBatchError) as rows:
        build_batch(bad, vocab_size=V, max_seq_len=32)
    with pytest.raises(BadBatchError) as cols:
        build_batch_columns(via_columns(bad), vocab_size=V, max_seq_len=32)
    assert (str(cols.value), cols.value.group_ids, cols.value.problems) == \
           (str(rows.value), rows.value.group_ids, rows.value.problems)


def test_failed_samples_are_not_checked_and_keep_no_reward():
    g = Group(group_id="f", samples=[_sample("f", 0, [1, 2, 3], 1), _sample("f", 1, [V + 1, 7], 1, None, "failed"),
                                     _sample("f", 2, [1, 2, 4], 1, 0.5, "failed")])
    b = build_batch_columns(via_columns([g]), vocab_size=V)
    assert [s.failed for s in b.samples] == [False, True, True]
    assert b.rewards()[1].tolist() == [True, False, False]
    assert [mb.sample_ids for mb in micro_batches_for_rank(b, 1, 0, 100)] == [[0]]
