"""The reference engine's decoder, cache, sampler and scheduler in-process (no HTTP).

Logits are compared with ``transformers`` on the same safetensors for every supported family;
the sampler's parameters and logprob modes are checked against their definitions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from headrace.rollout.engine.model import DecoderModel, KVCache
from headrace.rollout.engine.sampling import BatchSampler, parse_sampling_params
from headrace.rollout.engine.scheduler import Scheduler, Seq
from headrace.rollout.engine.text import TextCodec


@pytest.fixture(scope="module", params=["tiny-qwen2", "qwen3-tiny", "tiny-llama"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from headrace.shared.modelzoo import init_model

    return init_model(request.param, tmp_path_factory.mktemp("m") / request.param, seed=3)


def test_prefill_and_decode_match_transformers(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = DecoderModel.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, 400, (3, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits.float()
    cache = KVCache(model.arch, model.dtype, rows=1, capacity=4)     # forces both kinds of growth
    lens = torch.tensor([9, 6, 4])                                    # right-padded prefill
    cache.ensure(3, 10)
    logits = model.forward(ids[:, :9].clone(), cache, 0, last=lens - 1)
    for b in range(3):
        torch.testing.assert_close(logits[b], ref[b, lens[b] - 1], atol=1e-4, rtol=1e-4)
    for _ in range(4):                                                # decode, one token per row
        cache.ensure(3, int(lens.max()) + 1)
        logits = model.forward(ids[torch.arange(3), lens].view(3, 1), cache, 0, lens=lens)
        for b in range(3):
            torch.testing.assert_close(logits[b], ref[b, lens[b]], atol=1e-4, rtol=1e-4)
        lens = lens + 1


def test_load_weights_checks_everything_before_copying(model_dir: Path) -> None:
    model = DecoderModel.from_pretrained(model_dir)
    norm = model.get_weight("model.norm.weight").clone()
    with pytest.raises(ValueError, match="shape"):
        model.load_weights([("model.norm.weight", torch.zeros_like(norm)), ("model.embed_tokens.weight", torch.ones(2))])
    with pytest.raises(ValueError, match="unknown weight name"):
        model.load_weights([("model.layers.99.mlp.up_proj.weight", torch.ones(2))])
    assert torch.equal(model.get_weight("model.norm.weight"), norm)    # nothing was copied
    assert model.load_weights([("model.norm.weight", norm * 2)]) == 1
    assert torch.equal(model.get_weight("model.norm.weight"), norm * 2)


def _logits(v: int = 50, rows: int = 6) -> torch.Tensor:
    return torch.randn(rows, v, generator=torch.Generator().manual_seed(1)) * 3


def test_sampler_greedy_top_k_1_and_tiny_top_p_are_the_argmax() -> None:
    logits = _logits()
    sampler = BatchSampler(seed=0)
    for raw in ({"temperature": 0.0}, {"top_k": 1}, {"top_p": 1e-6}):
        sp = parse_sampling_params(raw, 50)
        ids, lps = sampler.sample(logits, [sp] * 6, [None] * 6)
        assert torch.equal(ids, logits.argmax(-1))
        assert torch.isfinite(lps).all() and (lps <= 0).all()


def test_sampler_logprob_modes() -> None:
    logits = _logits()
    sp = parse_sampling_params({"temperature": 0.5, "top_k": 3}, 50)
    for mode in ("temperature", "original", "processed"):
        ids, lps = BatchSampler(seed=0, logprob_mode=mode).sample(logits, [sp] * 6, [None] * 6)
        top3 = logits.topk(3, dim=-1).indices
        assert all(int(i) in top3[b].tolist() for b, i in enumerate(ids))       # only the top 3 are drawn
        if mode == "temperature":       # SGLang's default: log softmax(logits / T), not renormalised
            ref = torch.log_softmax(logits / 0.5, -1)
        elif mode == "original":
            ref = torch.log_softmax(logits, -1)
        else:                           # the distribution actually sampled from
            masked = (logits / 0.5).masked_fill(~torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top3, True),
                                                float("-inf"))
            ref = torch.log_softmax(masked, -1)
        torch.testing.assert_close(lps, ref.gather(1, ids.view(-1, 1)).view(-1), atol=1e-5, rtol=1e-5)


def test_sampler_matches_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -30.0]]).repeat(4000, 1)
    sp = parse_sampling_params({"temperature": 1.0}, 4)
    ids, _ = BatchSampler(seed=0).sample(logits, [sp] * 4000, [None] * 4000)
    freq = torch.bincount(ids, minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.softmax(logits[0], -1), atol=0.03, rtol=0)
    sp = parse_sampling_params({"temperature": 1.0, "top_p": 0.7}, 4)   # nucleus = {2, 1}
    ids, _ = BatchSampler(seed=0).sample(logits, [sp] * 4000, [None] * 4000)
    assert set(ids.tolist()) == {1, 2}


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = _logits(rows=3)
    sp = parse_sampling_params({"sampling_seed": 5}, 50)
    free = parse_sampling_params({}, 50)
    a, _ = BatchSampler(seed=0).sample(logits[:1], [sp], [torch.Generator().manual_seed(5)])
    b, _ = BatchSampler(seed=9).sample(logits, [sp, free, free],
                                       [torch.Generator().manual_seed(5), None, None])
    assert int(a[0]) == int(b[0])


def test_scheduler_retract_and_continue_loses_no_tokens(tmp_path: Path) -> None:
    """A sequence retracted mid-way and re-prefilled continues exactly like one never interrupted."""
    from headrace.shared.modelzoo import init_model

    model = DecoderModel.from_pretrained(init_model("micro-qwen2", tmp_path / "m"))
    sp = parse_sampling_params({"max_new_tokens": 20, "temperature": 0.0, "ignore_eos": True}, model.arch.vocab_size)

    def run(retract_at: int | None) -> list[int]:
        sch = Scheduler(model, TextCodec(None), set())
        done: list[Seq] = []
        sch.add([Seq(rid="x", group="x", prompt=[5, 6, 7, 8], params=sp, return_logprob=False, on_finish=done.append)])
        while not done:
            sch._admit()
            if sch.running:
                sch._decode()
            if retract_at is not None and sch.running and len(sch.running[0].output) == retract_at:
                sch.pause("retract")
                assert not sch.running and sch.waiting[0].cached == 0
                sch.resume()
                retract_at = None
        return done[0].output

    assert run(7) == run(None)


def test_identical_prompts_in_one_admission_are_prefilled_once_and_decode_as_if_alone(tmp_path: Path) -> None:
    """The n samples of a prompt share one prefill (cache row and logits copied), and each still
    decodes exactly as it would alone: greedy rows agree with solo runs, seeded rows sample on."""
    from headrace.shared.modelzoo import init_model

    model = DecoderModel.from_pretrained(init_model("micro-qwen2", tmp_path / "m"))
    vocab = model.arch.vocab_size
    greedy = parse_sampling_params({"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}, vocab)
    a, b, c = [5, 6, 7, 8], [9, 3, 4, 11, 12, 2, 7], [5, 6, 7]

    def run(prompts: list[list[int]], seeds: list[int | None]) -> tuple[list[Seq], Scheduler]:
        sch = Scheduler(model, TextCodec(None), set())
        done: list[Seq] = []
        seqs = []
        for k, (p, seed) in enumerate(zip(prompts, seeds)):
            sp = greedy if seed is None else parse_sampling_params(
                {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True}, vocab)
            seqs.append(Seq(rid=str(k), group=str(k), prompt=p, params=sp, return_logprob=True, on_finish=done.append,
                            generator=None if seed is None else torch.Generator().manual_seed(seed)))
        sch.add(seqs)
        while len(done) < len(seqs):
            sch._admit()
            if sch.running:
                sch._decode()
        return seqs, sch

    prompts = [a, b, a, a, b, c]
    seeds = [None, None, None, 7, 8, None]
    together, sch = run(prompts, seeds)
    assert (sch.prefilled, sch.prefill_shared) == (3, 3)   # a, b, c once each; three copies
    assert sch.state()["prefill_shared_rows"] == 3
    for s, p, seed in zip(together, prompts, seeds):
        [alone], solo = run([p], [seed])
        assert solo.prefill_shared == 0
        assert s.output == alone.output, (p, seed)
        assert s.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert together[0].output == together[2].output        # greedy copies agree
    assert together[3].output != together[0].output        # a seeded copy samples its own tokens
