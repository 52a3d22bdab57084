"""Build the model that examples/configs/agent_calculator.yaml trains: ``models/tiny-qwen2-agent``.

A fresh ``tiny-qwen2-tools`` (``headrace init-model``: the demo's ``tiny-qwen2`` whose tokenizer
has single tokens for the tool template's fixed text, so the agent's first prompt is ~100 tokens,
not ~500; its chat template lists ``tools`` in a system turn and renders Hermes ``<tool_call>``
blocks), then a short supervised warm-up in exactly the chat
format the ReAct agent's first request renders to through the gateway: the calculator tool listed,
the chain_sum question (``TASK_CONFIG``: two one-digit terms, as the config trains) as the user turn, the answer then ``<|im_end|>``. It stops at ~0.22 greedy
accuracy (``WARM_STEPS`` at most: in this format that takes ~140 steps, past ``warm_start``'s
default of 120, which stopped at 0.13 and left GRPO too few groups with a right answer), so GRPO
has room to show learning. The tiny model answers directly; it is never taught to
call the tool (the gateway's tool-call path is covered by tests/rollout/test_gateway*.py).

    python examples/agents/prepare_model.py [--out models/tiny-qwen2-agent] [--seed 0]

Cached: a second run with the same source weights, template and arguments returns at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from react_calculator import TOOLS  # noqa: E402

TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # = the config's task_config
WARM_STEPS = 400   # an upper bound: the warm-up stops once greedy accuracy reaches 0.22 (step 136, seed 0)


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="models/tiny-qwen2-agent")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    from headrace.deploy.demo import warm_start
    from headrace.shared.modelzoo import init_model

    out = Path(args.out)
    base = out.with_name(out.name + "-base")
    if not (base / "config.json").is_file():
        init_model("tiny-qwen2-tools", base, seed=args.seed)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    print(f"supervised warm-up of {base} in the agent's chat format -> {out}", flush=True)
    path = warm_start(base, out, steps=WARM_STEPS, seed=args.seed, chat_tools=TOOLS, task_config=TASK_CONFIG,
                      log=lambda m: print(m, flush=True))
    print(f"ready: {path}")
    return path


if __name__ == "__main__":
    main()
