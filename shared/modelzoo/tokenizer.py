"""The small offline tokenizer of the random-init presets, and loading any model directory's tokenizer.

Guarantees:
- ``build_tokenizer()`` is a byte-level BPE trained with the ``tokenizers`` library on a built-in,
  procedurally generated corpus (arithmetic in the phrasing of reasoning-gym tasks plus templated
  English). It is the same for every call and every preset: the corpus comes from a fixed seed.
- Every digit is its own token (digits are split before BPE, so no merge can join two digits),
  and any text round-trips (byte-level alphabet: nothing is unknown).
- The instruction phrase of reasoning-gym's arithmetic tasks (``PHRASES``) is one (non-special)
  token; the total vocabulary is exactly ``VOCAB_SIZE`` = 512. With ``tool_phrases`` the tool
  template's fixed text (``TOOL_PHRASES``) is too, in the same 512; without it nothing changes.
- The special tokens are ``<|endoftext|>`` (id 0; eos and pad), ``<|im_start|>`` (1) and
  ``<|im_end|>`` (2), with a ChatML chat template.
- ``load_tokenizer(dir)`` builds a ``PreTrainedTokenizerFast`` from ``tokenizer.json`` directly, never
  through AutoTokenizer (which, for model_type qwen2, swaps in another pre-tokenizer and changes ids).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]
VOCAB_SIZE = 512
# Whole phrases that get one token each: the fixed instruction of reasoning-gym's arithmetic tasks.
# Real tokenizers have long tokens for frequent text; this keeps the demo's prompts ~10 tokens long,
# which halves the cost of every rollout and training step on a CPU.
PHRASES = ["State the final answer to the following arithmetic problem:"]
# With ``build_tokenizer(tool_phrases=True)`` (preset ``tiny-qwen2-tools``), also the fixed text that
# the chat template writes around ``tools`` and tool calls, and the JSON-schema boilerplate of an
# OpenAI tool definition: as in real tokenizers, where they cost a few tokens, an agent's first
# prompt stays ~60-130 tokens instead of ~500 (what the agent example's warm-up and RL pay for).
TOOL_PHRASES = [
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>",
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    '{"type": "function", "function": {"name": "', '"description": "',
    '"parameters": {"type": "object", "properties": {', '{"type": "string"}', '"required": [',
    '{"name": "', '"arguments": ',
]

# ChatML, plus Qwen2.5's Hermes-style tools (the agent gateway's format): with ``tools`` a system
# turn lists them as JSON inside <tools></tools>; an assistant message's ``tool_calls`` render as
# ``<tool_call>\n{"name": .., "arguments": ..}\n</tool_call>`` after its content; ``tool`` messages
# render as <tool_response> blocks inside one user turn. Without tools or tool calls the rendering
# is plain ChatML, exactly as before.
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for tc in message['tool_calls'] %}"
    "{%- set f = tc['function'] if tc['function'] is defined else tc %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' + f['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{%- if f['arguments'] is string %}{{- f['arguments'] }}{%- else %}{{- f['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = (
    "the a an of to and in is it that for on with as was be by this are or from at which not have "
    "has had but one all were we when there can more if no out so what up its about into than them "
    "only other new some could time these two may then do first any my now such like our over man "
    "me even most made after also did many before must through back years where much your way well "
    "down should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three number sum "
    "answer final following arithmetic problem question result value total add subtract plus minus "
    "equals compute calculate number numbers digit digits what is the answer solve step think "
    "assistant user system you are a helpful model true false yes no please give only"
).split()

_TEMPLATES = (
    "State the final answer to the following arithmetic problem: {expr} =",
    "What is {expr}?",
    "Calculate {expr}.",
    "Compute the value of {expr}.",
    "Solve: {expr} =",
    "{expr} = {val}",
    "Answer: {val}",
    "The answer is {val}.",
)


def _expression(rng: random.Random) -> tuple[str, int]:
    terms = [rng.randint(0, 10 ** rng.randint(1, 3) - 1) for _ in range(rng.randint(2, 5))]
    expr, val = str(terms[0]), terms[0]
    for t in terms[1:]:
        op = rng.choice("+-*" if rng.random() < 0.2 else "+-")
        expr += f" {op} {t}"
        val = val + t if op == "+" else val - t if op == "-" else val * t
    return expr, val


def corpus(lines: int = 4000, seed: int = 1234) -> Iterator[str]:
    """The built-in training text: arithmetic questions/answers and templated English."""
    rng = random.Random(seed)
    for i in range(lines):
        if i % 2 == 0:
            expr, val = _expression(rng)
            yield rng.choice(_TEMPLATES).format(expr=expr, val=val) + f"\nAnswer: {val}"
        else:
            n = rng.randint(5, 16)
            words = [rng.choice(_WORDS) for _ in range(n)]
            sentence = " ".join(words).capitalize() + rng.choice(".?!,:")
            yield sentence


def build_tokenizer(vocab_size: int = VOCAB_SIZE, *, tool_phrases: bool = False) -> "Tokenizer":
    """Train the preset tokenizer (deterministic; about a tenth of a second); ``tool_phrases`` adds
    ``TOOL_PHRASES`` as single tokens (the BPE learns that many fewer merges; same total)."""
    phrases = PHRASES + (TOOL_PHRASES if tool_phrases else [])
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(phrases),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(p, normalized=False, special=False) for p in phrases])
    return tok


def tokenizer_config(eos: str, pad: str, chat_template: str, bos: str | None = None,
                     model_max_length: int = 2048) -> dict[str, Any]:
    """The ``tokenizer_config.json`` we write next to ``tokenizer.json``."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": chat_template,
    }


def save_tokenizer(tok: "Tokenizer", out: Path, config: dict[str, Any]) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out``."""
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(model_dir: str | Path) -> "PreTrainedTokenizerFast":
    """The tokenizer of a model directory, built from its ``tokenizer.json`` with the special tokens
    and chat template of its ``tokenizer_config.json``."""
    from transformers import PreTrainedTokenizerFast

    d = Path(model_dir)
    tj = d / "tokenizer.json"
    if not tj.is_file():
        raise FileNotFoundError(f"{d}: no tokenizer.json (is this a model directory?)")
    cfg: dict[str, Any] = {}
    if (d / "tokenizer_config.json").is_file():
        cfg = json.loads((d / "tokenizer_config.json").read_text())
    kwargs = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if isinstance(cfg.get(k), str)}
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tj), clean_up_tokenization_spaces=False,
                                  model_max_length=int(cfg.get("model_max_length", 2048)), **kwargs)
    template = cfg.get("chat_template")
    if template is None and (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text()
    if template is not None:
        tok.chat_template = template
    return tok
