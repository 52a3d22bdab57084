"""rollout.prompts: a round's prompts tokenized in one call give exactly what each alone gives.

With the tiny-qwen2 tokenizer (a real fast tokenizer with a chat template): plain text, chat
messages and text through the chat template, mixed in one round; an item the template cannot
render and a tokenizer that refuses lists are left to the one-by-one path, which words the error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from headrace.rollout.data import PromptItem
from headrace.rollout.prompts import prompt_ids, prompt_ids_many


@pytest.fixture(scope="module")
def tok(tiny_model: Path) -> Any:
    from headrace.rollout.service import load_tokenizer

    return load_tokenizer(str(tiny_model))


def _items() -> list[PromptItem]:
    texts = ["12 + 7 =", "  leading spaces", "naïve café ✓ 東京", "<|im_start|>user in the text", "a\nb\n\nc", ""]
    chats = [[{"role": "user", "content": "What is 2 + 2?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]]
    prompts: list[Any] = texts + chats
    return [PromptItem(position=i, epoch=1, prompt=p) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("chat", [False, True])
def test_a_rounds_prompts_at_once_equal_each_alone(tok: Any, chat: bool) -> None:
    items = _items()
    many = prompt_ids_many(tok, items, chat)
    assert set(many) == {it.key for it in items}
    for it in items:
        assert many[it.key] == prompt_ids(tok, it, chat), it.prompt
    ids, text = many[items[-1].key]                       # chat messages: through the template
    assert text.endswith("<|im_start|>assistant\n") and tok.decode(ids) == text
    first = many[items[0].key]
    assert first == (list(tok("12 + 7 =")["input_ids"]), "12 + 7 =") if not chat else first[1].endswith("assistant\n")


def test_what_cannot_go_in_one_call_is_left_to_the_item_alone(tok: Any) -> None:
    items = _items()
    broken = PromptItem(position=99, epoch=1, prompt=[{"role": "user", "content": {"not": "text"}}])

    class NoLists:
        """A tokenizer that tokenizes one text at a time only."""
        apply_chat_template = tok.apply_chat_template

        def __call__(self, text: Any, **kw: Any) -> Any:
            if not isinstance(text, str):
                raise TypeError("one text at a time")
            return tok(text, **kw)

    many = prompt_ids_many(tok, items + [broken], False)
    assert broken.key not in many and all(it.key in many for it in items)
    with pytest.raises(Exception):        # the one-by-one path raises its own error (the group fails with it)
        prompt_ids(tok, broken, False)
    assert prompt_ids_many(NoLists(), items, False) == {}
    assert prompt_ids_many(tok, items[:1], False) == {}   # one item: nothing to gain


def test_ids_made_ahead_are_each_prompts_own_and_bounded_by_one_round(tok: Any) -> None:
    """``PromptIds``: a round's ids at once, the next round's ahead; ``take`` gives what
    ``prompt_ids`` gives whichever way they were made; a later ``ahead`` replaces what was made
    ahead and not taken; a slot that ends without taking its ids drops them."""
    from headrace.rollout.prompts import PromptIds

    items = _items()
    now, later, after = items[:3], items[3:6], items[6:]
    ids = PromptIds(tok, False)
    ids.for_round(now)
    ids.ahead(later)
    assert [ids.take(it) for it in now] == [prompt_ids(tok, it, False) for it in now] and ids.hits == 0
    assert ids.take(later[0]) == prompt_ids(tok, later[0], False) and ids.hits == 1
    ids.ahead(after)   # later[1:] were never drawn: forgotten
    assert set(ids._ahead) == {it.key for it in after} and not ids._round
    ids.for_round(after[:1] + later[1:])   # one made ahead, two not
    assert set(ids._round) == {later[1].key, later[2].key}
    ids.drop(later[1])
    assert set(ids._round) == {later[2].key}
    got = [ids.take(it) for it in after + later[1:]]
    assert got == [prompt_ids(tok, it, False) for it in after + later[1:]] and ids.hits == 1 + len(after)
    assert not ids._ahead and not ids._round
