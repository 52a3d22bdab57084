"""A prompt item's token ids, one at a time or a round's at once, and the sample made of them.

Guarantees:
- ``prompt_ids(tokenizer, item, chat)`` is the prompt's ids and the text they encode: chat messages
  (a list, or any prompt when ``chat``, i.e. ``data.apply_chat_template``) go through the
  tokenizer's chat template with the generation prompt, then are tokenized without special tokens;
  plain text is tokenized as the tokenizer's ``__call__`` does by default;
- ``prompt_ids_many(tokenizer, items, chat)`` gives, by item key, exactly what ``prompt_ids``
  gives each item, from one batched tokenizer call (on the 2-core machine 32 short prompts took
  ~0.33 ms together against ~0.6 ms one by one: transformers' fixed cost per call dominates).
  It is best effort: whatever it cannot do as one call (an item whose template or tokenization
  raises, a tokenizer that does not take a list) is left out, and ``prompt_ids`` then decides that
  item alone, with its own error;
- ``PromptIds`` holds ids made before a group needs them: a round's, made at once when the round
  draws its prompts (``for_round``), and the next round's, made while this round's requests are
  out (``ahead``: ``DataSource.peek`` of the prompts it will draw; on the 2-core machine a
  32-prompt round's tokenizing was ~8% of the rollout service's CPU, all of it before the round's
  first request could leave). ``take`` gives exactly what ``prompt_ids`` gives (ids are cached
  by item key, and a key's prompt never changes); what was made ahead is bounded by one round and
  replaced by the next ``ahead``;
- ``prompt_sample(**fields)`` is the sample a generator receives (prompt tokens, no response, no
  reward yet), built without validation: every sample a generator returns is checked later.
"""

from __future__ import annotations

from typing import Any

from headrace.rollout.columns_push import clone_sample
from headrace.rollout.data import PromptItem
from headrace.shared.schemas import Sample, SampleStatus

__all__ = ["PromptIds", "prompt_ids", "prompt_ids_many", "prompt_sample"]


def _text(tokenizer: Any, item: PromptItem, chat: bool) -> tuple[str, bool]:
    """The text to tokenize, and whether it came through the chat template."""
    p = item.prompt
    if isinstance(p, list) or chat:
        msgs = p if isinstance(p, list) else [{"role": "user", "content": p}]
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), True
    return p, False


def prompt_ids(tokenizer: Any, item: PromptItem, chat: bool) -> tuple[list[int], str]:
    """The module docstring's guarantees."""
    text, templated = _text(tokenizer, item, chat)
    if templated:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]), text
    return list(tokenizer(text)["input_ids"]), text


def prompt_ids_many(tokenizer: Any, items: list[PromptItem], chat: bool) -> dict[str, tuple[list[int], str]]:
    """The module docstring's guarantees."""
    if len(items) < 2:
        return {}
    plain: list[tuple[str, str]] = []      # (key, text) for each kind of call
    templated: list[tuple[str, str]] = []
    for item in items:
        try:
            text, t = _text(tokenizer, item, chat)
        except Exception:  # noqa: BLE001 - that item alone, later, words its error
            continue
        if isinstance(text, str):
            (templated if t else plain).append((item.key, text))
    out: dict[str, tuple[list[int], str]] = {}
    for batch, kwargs in ((plain, {}), (templated, {"add_special_tokens": False})):
        if not batch:
            continue
        try:
            ids = tokenizer([text for _, text in batch], **kwargs)["input_ids"]
        except Exception:  # noqa: BLE001 - one by one, later, where each error is its own
            continue
        if len(ids) == len(batch):
            out.update((key, (list(x), text)) for (key, text), x in zip(batch, ids))
    return out


class PromptIds:
    """Prompt ids made before their groups are produced (the module docstring's guarantees)."""

    def __init__(self, tokenizer: Any, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self._round: dict[str, tuple[list[int], str]] = {}   # item key -> ids, text: drawn, until produced
        self._ahead: dict[str, tuple[list[int], str]] = {}   # the same for prompts not drawn yet
        self.hits = 0   # prompts whose ids were made ahead

    def for_round(self, items: list[PromptItem]) -> None:
        """Make the ids of a round's drawn ``items`` in one call (those not made ahead)."""
        todo = [it for it in items if it.key not in self._ahead]
        self._round.update(prompt_ids_many(self.tokenizer, todo, self.chat))

    def ahead(self, items: list[PromptItem]) -> None:
        """Make the ids of ``items``, prompts a later round will draw, in place of those made ahead before."""
        self._ahead = prompt_ids_many(self.tokenizer, [it for it in items if it.key not in self._round], self.chat)

    def take(self, item: PromptItem) -> tuple[list[int], str]:
        """``prompt_ids`` of ``item``, made ahead or now."""
        got = self._round.pop(item.key, None)
        if got is None:
            got = self._ahead.pop(item.key, None)
            self.hits += got is not None
        return got if got is not None else prompt_ids(self.tokenizer, item, self.chat)

    def drop(self, item: PromptItem) -> None:
        """Forget ``item``'s ids (its slot ended without taking them)."""
        self._round.pop(item.key, None)


_PROMPT_SAMPLE = Sample.model_construct(uid="", group_id="", tokens=[], index=0, response_length=0, loss_mask=[],
                                        rollout_logprobs=None, reward=None, status=SampleStatus.completed.value,
                                        weight_version=0, prompt=None, response=None, label=None, metadata={})


def prompt_sample(**fields: Any) -> Sample:
    """The sample a generator receives: prompt tokens, empty response, no reward yet.

    Built without validation because its reward is legitimately unset until it is scored; every
    sample a generator returns is checked (``columns_push.check_outputs``) before it goes anywhere.
    A copy of one unvalidated template with its own lists and map (every field set, as
    ``model_construct`` with each default given sets them; a third of its cost).
    """
    return clone_sample(_PROMPT_SAMPLE, {"loss_mask": [], "metadata": {}, **fields})
