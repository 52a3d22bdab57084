"""deploy.demo: the CPU demo's recipe (prompt, binary reward, held-out eval items, config, warm start)."""

from __future__ import annotations

from pathlib import Path

import pytest

from headrace.deploy import demo
from headrace.shared.modelzoo import init_model, load_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model("tiny-qwen2", tmp_path_factory.mktemp("m") / "tiny", seed=0)


def test_reward_binary() -> None:
    entries = demo.task_items(0, 20)
    for e in entries:
        right = str(e["answer"])
        wrong = str(int(e["answer"]) + 1)
        assert demo.reward(right, e) == 1.0
        assert demo.reward(f" {right}<|endoftext|>", e) == 1.0     # end token and spaces tolerated
        assert demo.reward(wrong, e) == 0.0
        assert demo.reward("", e) == 0.0
    e = entries[0]
    import reasoning_gym

    partial = f"x {e['answer']}"
    assert 0 < reasoning_gym.get_score_answer_fn("chain_sum")(partial, e) < 1.0   # partial credit there
    assert demo.reward(partial, e) == 0.0                                          # none here


def test_items_follow_the_task_config() -> None:
    for e in demo.task_items(3, 50):
        terms = e["metadata"]["expression"].split()[::2]
        assert 2 <= len(terms) <= 3 and all(len(t) == 1 and t.isdigit() for t in terms)
        assert demo.render_prompt(e["question"]).endswith("= ")


def test_eval_items_do_not_replay_training_items() -> None:
    train = [e["question"] for e in demo.task_items(0, 3000)]
    ev = [e["question"] for e in demo.eval_items(64, seed=0)]
    # a nearby seed replays the training stream shifted by one index (why eval uses seed + 10**7) ...
    near = [e["question"] for e in demo.task_items(1, 64)]
    assert near[:-1] == train[1:64]
    # ... the evaluation stream is not a shifted copy: no window of 4 eval items occurs in training
    windows = {tuple(train[i:i + 4]) for i in range(len(train) - 3)}
    assert not any(tuple(ev[i:i + 4]) in windows for i in range(len(ev) - 3))
    assert demo.TRAIN_POOL < demo.EVAL_SEED_OFFSET


def test_demo_config_is_a_valid_run_config() -> None:
    from headrace.shared.config import HeadraceConfig

    d = demo.demo_config_dict("models/x", "runs/y", steps=42)
    cfg = HeadraceConfig.model_validate(d)
    assert cfg.model == "models/x" and cfg.run.out == "runs/y" and cfg.trainer.steps == 42
    assert cfg.rollout.data.task == "chain_sum" and cfg.rollout.data.prompt_template == demo.PROMPT_TEMPLATE
    assert (cfg.rollout.n_samples_per_prompt, cfg.rollout.groups_per_step) == (8, 64)
    assert cfg.rollout.max_concurrency == 8 * 64              # a step's sequences all in flight at once
    assert cfg.rollout.sampling.temperature == 1.0 and cfg.trainer.lr == 1e-4 and cfg.trainer.grad_clip == 1.0
    assert cfg.rollout.reward == demo.REWARD
    colocated = HeadraceConfig.model_validate(demo.demo_config_dict(placement="colocated"))
    assert colocated.rollout.mode == "on_demand"


def test_rollout_data_source_renders_the_same_prompts() -> None:
    data = pytest.importorskip("headrace.rollout.data")
    from headrace.shared.config import HeadraceConfig

    cfg = HeadraceConfig.model_validate(demo.demo_config_dict()).rollout.data.model_copy(update={"size": 16, "eval_size": 8})
    train = data.load_items(cfg)
    assert [p for p, _, _ in train] == [demo.render_prompt(e["question"]) for e in demo.task_items(0, 16)]
    ev = data.load_items(cfg, eval=True)
    assert [p for p, _, _ in ev] == [demo.render_prompt(e["question"]) for e in demo.eval_items(8, 0)]


def test_generate_matches_transformers_greedy(tiny: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    tok = load_tokenizer(tiny)
    prompts = [tok(demo.render_prompt(e["question"]))["input_ids"] for e in demo.task_items(5, 6)]
    ours, lps = demo.generate(model, prompts, max_new_tokens=5, eos_id=tok.eos_token_id)
    for p, r, lp in zip(prompts, ours, lps):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        assert r == ref[0, len(p):].tolist()[:len(r)]
        assert all(x <= 0 for x in lp) and len(lp) == len(r)
    # logprobs of the sampled tokens agree with a full forward pass
    full, masks, rows = demo.sequence_logprobs(model, prompts, ours, pad_id=tok.eos_token_id)
    for lp, m, idx in zip(full, masks, rows):
        for j, i in enumerate(idx):
            assert torch.allclose(lp[j, :len(ours[i])], torch.tensor(lps[i]), atol=1e-4)


def test_warm_start_trains_saves_and_caches(tiny: Path, tmp_path: Path) -> None:
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    kw = dict(steps=3, batch=16, lr=1e-3, target_accuracy=1.0, min_steps=100, eval_n=16)
    out = demo.warm_start(tiny, tmp_path / "w", **kw)
    meta = json.loads((out / "warm_start.json").read_text())
    assert meta["steps_run"] == 3 and 0.0 <= meta["accuracy"] <= 1.0
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.model_type == "qwen2"
    assert load_tokenizer(out).eos_token == "<|endoftext|>"
    before = load_file(tiny / "model.safetensors")
    after = load_file(out / "model.safetensors")
    assert set(before) == set(after)
    assert any(not torch.equal(before[k], after[k]) for k in before)       # it trained
    # cached: same source and arguments -> returned untouched
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert demo.warm_start(tiny, tmp_path / "w", **kw) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    # deterministic: a second directory gets the same weights
    again = load_file(demo.warm_start(tiny, tmp_path / "w2", **kw) / "model.safetensors")
    assert all(torch.equal(after[k], again[k]) for k in after)
    acc = demo.greedy_accuracy(out, n=8)
    assert 0.0 <= acc <= 1.0


def test_warm_start_rejects_bad_arguments(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="batch"):
        demo.warm_start(tiny, tmp_path / "x", batch=0)


TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def test_chat_format_is_what_the_template_renders_and_ends_with_im_end(tiny: Path) -> None:
    tok = load_tokenizer(tiny)
    fmt = demo.PromptFormat(tok, TOOLS)
    q = "State the final answer to the following arithmetic problem: 4 + 3 ="
    want = tok.apply_chat_template([{"role": "user", "content": q}], tools=TOOLS, add_generation_prompt=True,
                                   tokenize=False)
    assert tok.decode(fmt.prompt_ids(q)) == want and want.endswith("<|im_start|>assistant\n")
    assert "<tools>" in want and q in want
    assert fmt.answer_ids(7)[-1] == tok.convert_tokens_to_ids("<|im_end|>") == fmt.end_id
    assert tok.decode(fmt.answer_ids(-12)[:-1]) == "-12"
    plain = demo.PromptFormat(tok)
    assert plain.prompt_ids(q) == tok(demo.render_prompt(q))["input_ids"] and plain.end_id == tok.eos_token_id


def test_warm_start_in_chat_format_records_its_format_and_task(tiny: Path, tmp_path: Path) -> None:
    import json

    cfg = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    kw = dict(steps=2, batch=8, target_accuracy=1.0, min_steps=100, eval_n=8, chat_tools=TOOLS, task_config=cfg)
    out = demo.warm_start(tiny, tmp_path / "chat", **kw)
    meta = json.loads((out / "warm_start.json").read_text())
    assert meta["steps_run"] == 2 and meta["args"]["chat_tools"] == TOOLS and meta["args"]["task_config"] == cfg
    plain = demo.warm_start(tiny, tmp_path / "plain", steps=2, batch=8, target_accuracy=1.0, min_steps=100, eval_n=8)
    assert json.loads((plain / "warm_start.json").read_text())["fingerprint"] != meta["fingerprint"]
    assert all(e["metadata"]["num_terms"] == 2 for e in demo.task_items(0, 20, cfg))


def test_tools_preset_tokenizer_keeps_the_tool_template_short(tmp_path: Path) -> None:
    from headrace.shared.modelzoo.tokenizer import PHRASES, TOOL_PHRASES, VOCAB_SIZE, build_tokenizer

    tools = load_tokenizer(init_model("tiny-qwen2-tools", tmp_path / "t", seed=0))
    plain = build_tokenizer()
    assert len(tools) == VOCAB_SIZE == plain.get_vocab_size()
    assert plain.token_to_id(TOOL_PHRASES[0]) is None and plain.token_to_id(PHRASES[0]) is not None
    for p in TOOL_PHRASES:
        assert len(tools(p, add_special_tokens=False)["input_ids"]) == 1, p
    msgs = [{"role": "user", "content": "What is 4 + 3 ="},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "c1", "function": {
                "name": "calculator", "arguments": '{"expression": "4 + 3"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "7"}]
    text = tools.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    ids = tools(text, add_special_tokens=False)["input_ids"]
    assert tools.decode(ids) == text                     # round-trips
    first = tools.apply_chat_template(msgs[:1], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert len(tools(first, add_special_tokens=False)["input_ids"]) < 110
