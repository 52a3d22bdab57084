"""The recipe of the built-in CPU demo: task, prompt format, reward, run config and supervised warm-up.

The demo (DESIGN.md, "Facts measured on the 2-core development machine"): the ~1M-parameter
``tiny-qwen2`` preset learns reasoning-gym ``chain_sum`` with 2-3 single-digit terms. A short
supervised warm-up (``warm_start``) brings greedy accuracy to ~0.2-0.25, leaving room for GRPO to
show learning; then GRPO with 64 prompts x 8 samples, temperature 1.0, AdamW lr 1e-4, grad clip 1.0
and a binary reward (reasoning-gym's ``score_answer`` == 1.0; it gives partial credit otherwise).

Guarantees:
- The prompt of an item is ``PROMPT_TEMPLATE.format(prompt=question)``; the model answers with the
  number and ``<|endoftext|>``. ``extract_answer`` / ``reward`` read a response the way the
  rollout's ``reasoning_gym_binary`` reward does (text before the end token, stripped).
- Training items come from reasoning-gym seed ``seed``, evaluation items from ``seed + 10**7``
  (reasoning-gym seeds shift item indices, so nearby seeds replay the training items).
- ``warm_start`` is deterministic for its arguments at a fixed torch thread count, and caches: a
  second call with the same source weights and arguments returns the saved directory unchanged.

Torch and transformers are imported inside the functions that need them.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch

TASK = "chain_sum"
TASK_CONFIG: dict[str, Any] = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
PROMPT_TEMPLATE = "{prompt} "     # the question ends with " ="; the model answers e.g. "-3<|endoftext|>"
EVAL_SEED_OFFSET = 10**7
MAX_NEW_TOKENS = 8            # longest answer "-18" is 3 tokens, plus the end token
TRAIN_POOL = 100_000          # rollout.data.size; far below EVAL_SEED_OFFSET, so the pools never meet
REWARD = "reasoning_gym_binary"
END = "<|endoftext|>"


# ---- task, prompts, reward --------------------------------------------------------------------


def task_items(seed: int, size: int, task_config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """``size`` reasoning-gym ``chain_sum`` entries (question, answer, metadata) from ``seed``
    (``task_config`` default: the demo's ``TASK_CONFIG``)."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset(TASK, seed=seed, size=size, **(task_config or TASK_CONFIG))
    return [ds[i] for i in range(size)]


def eval_items(n: int = 128, seed: int = 0, task_config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The held-out evaluation entries: drawn from ``seed + 10**7``, never the training stream."""
    return task_items(seed + EVAL_SEED_OFFSET, n, task_config)


def render_prompt(question: str) -> str:
    """The prompt text the model sees for a task question."""
    return PROMPT_TEMPLATE.format(prompt=question)


def extract_answer(response: str) -> str:
    """The answer in a response: the text before the first end token, whitespace stripped."""
    return response.split(END, 1)[0].strip()


def reward(response: str, entry: dict[str, Any]) -> float:
    """Binary reward: 1.0 when reasoning-gym scores the extracted answer 1.0, else 0.0."""
    import reasoning_gym

    score = reasoning_gym.get_score_answer_fn(TASK)(extract_answer(response), entry)
    return 1.0 if score >= 1.0 else 0.0


# ---- the run config ---------------------------------------------------------------------------


def demo_config_dict(model: str = "models/tiny-qwen2", out: str = "runs/demo", *, steps: int = 300,
                     seed: int = 0, eval_every: int = 25, eval_size: int = 512,
                     placement: str = "colocated") -> dict[str, Any]:
    """The demo's run YAML as a dict, in the keys of ``shared.config.HeadraceConfig``.

    64 prompts x 8 samples per step, lr 1e-4. Measured with ``headrace run`` on the 2-core machine
    (seed 0, greedy pass@1 on 512 held-out prompts): 64 prompts per step took ~1.7 s a step and went
    0.25 -> 0.55 by step 175 (~300 s) and 0.61-0.65 from step 225 on; 32 prompts per step (~1 s a
    step) got there later and swung more (0.38-0.54 between steps 200 and 400); lr 2e-4 with 32
    prompts oscillated around 0.45. So 300 steps fit in 10 minutes with the warm-up. On 5 Dec (this
    machine, the same warm model; the code of 1 Dec scores it 0.199 here too): ~0.55 s a step,
    0.199 -> 0.518 and 0.199 -> 0.553 at step 300, ~3 min in all.

    ``placement`` defaults to colocated: on 2 cores the synchronous loop is both faster
    (bench/async_vs_sync.py: disaggregated reaches ~0.7x its samples/s, since engine and trainer
    share the same cores) and on-policy, and in ``headrace run`` it reached 0.51 eval at step 220
    where the disaggregated loop was at 0.27-0.34.
    """
    return {
        "model": model,
        "buffer": {"capacity": 4096, "max_staleness": 1},
        "rollout": {
            "engines": {"backend": "reference", "count": 1},
            "data": {"task": TASK, "task_config": dict(TASK_CONFIG), "size": TRAIN_POOL, "seed": seed,
                     "prompt_template": PROMPT_TEMPLATE, "eval_size": eval_size, "shuffle": True},
            "n_samples_per_prompt": 8,
            "groups_per_step": 64,
            "max_concurrency": 512,         # the whole step's 64 x 8 sequences in flight at once
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": MAX_NEW_TOKENS},
            "eval_sampling": {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": MAX_NEW_TOKENS},
            "reward": REWARD,
            "filter": None,
            "mode": "continuous" if placement == "disaggregated" else "on_demand",
        },
        "trainer": {"lr": 1.0e-4, "grad_clip": 1.0, "algorithm": "grpo", "aggregation": "token_mean",
                    "kl_coef": 0.0, "entropy_coef": 0.0, "weight_decay": 0.0, "steps": steps,
                    "ppo_epochs": 1, "mini_batches": 1, "seed": seed},
        "run": {"placement": placement, "out": out, "eval_every": eval_every},
    }


# ---- batched generation (plain transformers model, KV cache, no padding) ---------------------


def _by_length(prompts: Sequence[Sequence[int]]) -> dict[int, list[int]]:
    buckets: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        buckets.setdefault(len(p), []).append(i)
    return buckets


def generate(model: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_id: int,
             temperature: float = 0.0, generator: "torch.Generator | None" = None
             ) -> tuple[list[list[int]], list[list[float]]]:
    """Sample (or greedy-decode, ``temperature == 0``) a response per prompt with a HF causal LM.

    Prompts of equal length run as one batch, so no padding is ever needed. A response ends at and
    includes the first ``eos_id``. Returns (response ids, logprobs of each sampled token under the
    distribution actually sampled from, i.e. after temperature).
    """
    import inspect

    import torch

    # transformers >= 5.2x names the KV cache argument ``cache``; older releases ``past_key_values``
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    responses: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    with torch.no_grad():
        for _, idx in sorted(_by_length(prompts).items()):
            ids = torch.tensor([list(prompts[i]) for i in idx], dtype=torch.long)
            done = torch.zeros(len(idx), dtype=torch.bool)
            out = model(input_ids=ids, use_cache=True)
            past, logits = getattr(out, cache_arg), out.logits[:, -1, :].float()
            for _step in range(max_new_tokens):
                if temperature > 0:
                    lp = torch.log_softmax(logits / temperature, dim=-1)
                    tok = torch.multinomial(lp.exp(), 1, generator=generator).squeeze(1)
                else:
                    lp = torch.log_softmax(logits, dim=-1)
                    tok = lp.argmax(-1)
                chosen = lp.gather(1, tok[:, None]).squeeze(1)
                for j, i in enumerate(idx):
                    if not done[j]:
                        responses[i].append(int(tok[j]))
                        logprobs[i].append(float(chosen[j]))
                done |= tok == eos_id
                if bool(done.all()):
                    break
                out = model(input_ids=tok[:, None], use_cache=True, **{cache_arg: past})
                past, logits = getattr(out, cache_arg), out.logits[:, -1, :].float()
    return responses, logprobs


def sequence_logprobs(model: Any, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                      pad_id: int) -> tuple[list["torch.Tensor"], list["torch.Tensor"], list[list[int]]]:
    """Log-probabilities (with grad) of each response given its prompt, one forward per prompt length.

    Returns, per bucket, logprobs ``[b, T]``, mask ``[b, T]`` and the indices of its rows; responses
    are right-padded with ``pad_id`` (masked out; causal attention never looks right).
    """
    import torch

    lps, masks, rows = [], [], []
    for plen, idx in sorted(_by_length(prompts).items()):
        t = max(1, max(len(responses[i]) for i in idx))
        ids = torch.full((len(idx), plen + t), pad_id, dtype=torch.long)
        mask = torch.zeros(len(idx), t)
        for j, i in enumerate(idx):
            seq = list(prompts[i]) + list(responses[i])
            ids[j, :len(seq)] = torch.tensor(seq)
            mask[j, :len(responses[i])] = 1.0
        logits = model(input_ids=ids).logits[:, plen - 1:plen - 1 + t, :].float()
        lp = torch.log_softmax(logits, dim=-1).gather(2, ids[:, plen:plen + t, None]).squeeze(2)
        lps.append(lp)
        masks.append(mask)
        rows.append(idx)
    return lps, masks, rows


# ---- evaluation and supervised warm-up ---------------------------------------------------------


def _load(model_dir: str | Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from headrace.shared.modelzoo import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model, load_tokenizer(model_dir)


class PromptFormat:
    """How warm-up and accuracy present a question to the model and where its answer ends.

    ``chat_tools`` None: the demo's plain text (``render_prompt``, answer then the end token).
    A list (empty or not): the model's chat template with one user turn, the tools listed as the
    template lists them (what an OpenAI-SDK agent sends through the gateway), the generation prompt
    added; the answer ends with the template's end-of-turn token ``<|im_end|>``.
    """

    def __init__(self, tok: Any, chat_tools: list[dict[str, Any]] | None = None):
        self.tok, self.chat_tools = tok, chat_tools
        end = "<|im_end|>" if chat_tools is not None else END
        self.end_id = tok.convert_tokens_to_ids(end)
        if self.end_id is None or self.end_id == tok.unk_token_id:
            raise ValueError(f"the tokenizer has no {end!r} token")

    def prompt_ids(self, question: str) -> list[int]:
        """The token ids the model sees before its answer."""
        if self.chat_tools is None:
            return self.tok(render_prompt(question))["input_ids"]
        text = self.tok.apply_chat_template([{"role": "user", "content": question}], tools=self.chat_tools or None,
                                            add_generation_prompt=True, tokenize=False)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def answer_ids(self, answer: Any) -> list[int]:
        """The target completion: the answer's text and the end token."""
        return self.tok(str(answer), add_special_tokens=False)["input_ids"] + [self.end_id]


def model_accuracy(model: Any, tok: Any, entries: Sequence[dict[str, Any]],
                   fmt: PromptFormat | None = None) -> float:
    """Greedy accuracy (binary reward) of an in-memory model on ``entries`` (in ``fmt``, default plain)."""
    fmt = fmt or PromptFormat(tok)
    was_training = model.training
    model.eval()
    prompts = [fmt.prompt_ids(e["question"]) for e in entries]
    responses, _ = generate(model, prompts, max_new_tokens=MAX_NEW_TOKENS, eos_id=fmt.end_id)
    model.train(was_training)
    texts = [tok.decode(r, skip_special_tokens=True) for r in responses]
    return sum(reward(t, e) for t, e in zip(texts, entries)) / max(1, len(entries))


def greedy_accuracy(model_dir: str | Path, n: int = 128, seed: int = 0) -> float:
    """Greedy accuracy of the model in ``model_dir`` on ``n`` evaluation items (seed + 10**7)."""
    model, tok = _load(model_dir)
    return model_accuracy(model, tok, eval_items(n, seed))


def _fingerprint(model_dir: Path, args: dict[str, Any]) -> str:
    h = hashlib.sha256(json.dumps(args, sort_keys=True).encode())
    names = ("config.json", "model.safetensors", "tokenizer.json")
    if "chat_tools" in args:           # the chat template renders the prompts
        names += ("tokenizer_config.json",)
    for name in names:
        h.update((model_dir / name).read_bytes())
    return h.hexdigest()


def warm_start(model_dir: str | Path, out_dir: str | Path, *, steps: int = 120, lr: float = 1e-3,
               batch: int = 128, seed: int = 0, target_accuracy: float = 0.22, check_every: int = 4,
               min_steps: int = 40, eval_n: int = 128, log: Any = None,
               chat_tools: list[dict[str, Any]] | None = None,
               task_config: dict[str, Any] | None = None) -> Path:
    """Supervised warm-up on question -> answer, saved as a HF directory at ``out_dir``.

    Trains on prompt + answer + end token (loss on the answer and end token only) with AdamW, and
    stops after ``steps`` steps or as soon as greedy accuracy on the evaluation items reaches
    ``target_accuracy`` (checked every ``check_every`` steps from ``min_steps``), so that the RL
    phase starts low enough to show learning. Writes ``warm_start.json`` (arguments, steps run,
    accuracy); a call whose source weights and arguments match that file returns at once.

    Measured on tiny-qwen2 (seed 0): lr 1e-3 reaches 0.27 greedy accuracy at step 100; 2e-3 and
    4e-3 learn slower (0.10 and 0.03 at step 100), so the default is 1e-3 with up to 120 steps.
    ``chat_tools`` (see ``PromptFormat``) trains in the chat format an agent's requests render to;
    ``task_config`` replaces the demo's chain_sum settings (default ``TASK_CONFIG``).
    """
    import torch

    src, out = Path(model_dir), Path(out_dir)
    if steps < 0 or batch < 1 or lr <= 0 or not 0 < target_accuracy <= 1:
        raise ValueError(f"warm_start: bad arguments steps={steps} batch={batch} lr={lr} "
                         f"target_accuracy={target_accuracy}")
    args = {"steps": steps, "lr": lr, "batch": batch, "seed": seed, "target_accuracy": target_accuracy,
            "check_every": check_every, "min_steps": min_steps, "eval_n": eval_n, "recipe": 1}
    if chat_tools is not None:
        args["chat_tools"] = chat_tools
    if task_config is not None:
        args["task_config"] = task_config
    fp = _fingerprint(src, args)
    meta_path = out / "warm_start.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("fingerprint") == fp:
        return out

    torch.manual_seed(seed)
    model, tok = _load(src)
    model.train()
    fmt = PromptFormat(tok, chat_tools)
    rng = random.Random(seed)
    pool = task_items(seed, max(batch * 8, 1024), task_config)
    evals = eval_items(eval_n, seed, task_config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    acc, done_steps = model_accuracy(model, tok, evals, fmt), 0
    for step in range(1, steps + 1):
        if acc >= target_accuracy:
            break
        chosen = [pool[rng.randrange(len(pool))] for _ in range(batch)]
        prompts = [fmt.prompt_ids(e["question"]) for e in chosen]
        answers = [fmt.answer_ids(e["answer"]) for e in chosen]
        lps, masks, _ = sequence_logprobs(model, prompts, answers, pad_id=fmt.end_id)
        loss = -sum((lp * m).sum() for lp, m in zip(lps, masks)) / sum(m.sum() for m in masks)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done_steps = step
        if step >= min_steps and (step % check_every == 0 or step == steps):
            acc = model_accuracy(model, tok, evals, fmt)
            if log:
                log(f"warm-up step {step}: loss {loss.item():.3f}, greedy accuracy {acc:.3f}")
    acc = model_accuracy(model, tok, evals, fmt)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    meta = {"fingerprint": fp, "source": str(src), "args": args, "steps_run": done_steps, "accuracy": acc}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return out


def prepare_demo_model(cache_dir: str | Path = "models", *, seed: int = 0, log: Any = print) -> Path:
    """The demo's warm-started model: ``tiny-qwen2`` from ``init_model``, then ``warm_start``.

    Both steps are cached under ``cache_dir`` (a second call returns at once), so every
    ``headrace run`` of the demo starts from the same weights.
    """
    import torch
    from transformers.utils import logging as hf_logging

    from headrace.shared.modelzoo import init_model

    hf_logging.disable_progress_bar()
    cache = Path(cache_dir)
    base = cache / "tiny-qwen2"
    if not (base / "config.json").is_file():
        init_model("tiny-qwen2", base, seed=seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, threads))
    try:
        if log:
            log(f"headrace run: supervised warm-up of {base} (cached in {cache / 'tiny-qwen2-warm'})")
        return warm_start(base, cache / "tiny-qwen2-warm", seed=seed)
    finally:
        torch.set_num_threads(threads)
