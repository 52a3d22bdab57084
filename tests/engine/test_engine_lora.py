"""LoRA on the reference engine over real HTTP: SGLang's ``/load_lora_adapter``,
``/unload_lora_adapter`` and ``lora_path`` in ``/generate``, with PEFT directories written by the
real ``peft`` library.

One engine process for the module (with the run token, so every call is authenticated): generation
with an adapter gives the merged model's tokens and logprobs (the merged copy, from PEFT's
``merge_and_unload``, loaded into the same engine with ``/update_weights_from_disk``; 1e-4), rows of
one batch with and without the adapter each get their own model, unload takes the name away, and
every bad input is one 4xx naming the problem with nothing loaded afterwards.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.engine.engine_contract import prompt_ids
from tests.engine.lora_support import write_peft_adapter
from tests.procs import Proc, child_env, free_port, headrace_cmd

TOKEN = "lora-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Lora:
    url: str
    root: Path
    model: Path
    proc: Proc

    def post(self, path: str, body: Any, **kw: Any) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, headers=AUTH, timeout=120, **kw)

    def loaded(self) -> dict[str, str]:
        cards = httpx.get(f"{self.url}/v1/models", headers=AUTH, timeout=30).json()["data"]
        return {c["id"]: c["root"] for c in cards[1:]}


@pytest.fixture(scope="module")
def eng(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lora]:
    from headrace.shared.modelzoo import init_model

    root = tmp_path_factory.mktemp("lora")
    model = init_model("tiny-qwen2", root / "model")
    allowed = root / "allowed"
    allowed.mkdir()
    write_peft_adapter(model, allowed / "ad", merged_out=allowed / "merged")
    port = free_port()
    proc = Proc(headrace_cmd("engine", "serve", "--model", str(model), "--port", str(port), "--threads", "1",
                             "--allowed-weight-dirs", str(allowed), "--max-body-mb", "1"),
                root / "engine.log", env=child_env(threads=1, HEADRACE_TOKEN=TOKEN))
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(f"{url}/health", timeout=120)
        yield Lora(url, root, model, proc)
    finally:
        proc.stop()


def gen(e: Lora, prompts: list[list[int]], lora: Any = None, n: int = 8) -> list[dict[str, Any]]:
    body: dict[str, Any] = {"input_ids": prompts, "return_logprob": True,
                            "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    if lora is not None:
        body["lora_path"] = lora
    r = e.post("/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


def lps(res: dict[str, Any]) -> list[float]:
    return [x[0] for x in res["meta_info"]["output_token_logprobs"]]


def assert_same(a: dict[str, Any], b: dict[str, Any], tol: float = 1e-4) -> None:
    assert a["output_ids"] == b["output_ids"]
    assert max(abs(x - y) for x, y in zip(lps(a), lps(b))) < tol, (lps(a), lps(b))


def test_an_adapter_gives_the_merged_models_logprobs_and_unloads(eng: Lora) -> None:
    prompts = [prompt_ids(1), prompt_ids(2, 5), prompt_ids(3, 11)]
    base = gen(eng, prompts)
    r = eng.post("/load_lora_adapter", {"lora_name": "v1", "lora_path": str(eng.root / "allowed" / "ad")})
    assert r.status_code == 200, r.text
    assert r.json() == {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                        "loaded_adapters": {"v1": str(eng.root / "allowed" / "ad")}}
    adapted = gen(eng, prompts, "v1")
    assert any(a["output_ids"] != b["output_ids"] for a, b in zip(adapted, base)), "the adapter changed nothing"
    # one batch, per-prompt adapters: each row gets its own model
    mixed = gen(eng, prompts, ["v1", None, "v1"])
    assert_same(mixed[0], adapted[0]), assert_same(mixed[1], base[1]), assert_same(mixed[2], adapted[2])
    # the merged model (PEFT's merge_and_unload) in the same engine gives the adapter's tokens and logprobs
    r = eng.post("/update_weights_from_disk", {"model_path": str(eng.root / "allowed" / "merged")})
    assert r.status_code == 200, r.text
    try:
        for a, m in zip(adapted, gen(eng, prompts)):
            assert_same(a, m)
    finally:
        assert eng.post("/update_weights_from_disk", {"model_path": str(eng.model)}).status_code == 200
    # unload: the name is gone for /generate and for a second unload; the base model is untouched
    r = eng.post("/unload_lora_adapter", {"lora_name": "v1"})
    assert r.status_code == 200 and r.json()["loaded_adapters"] == {}, r.text
    r = eng.post("/generate", {"input_ids": prompts[0], "lora_path": "v1", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "not loaded: v1" in r.json()["error"]["message"], r.text
    r = eng.post("/unload_lora_adapter", {"lora_name": "v1"})
    assert r.status_code == 400 and "v1 does not exist" in r.json()["error_message"], r.text
    for a, b in zip(gen(eng, prompts), base):
        assert_same(a, b, 1e-6)


def variant(eng: Lora, name: str, edit: Any = None, inside: bool = True) -> Path:
    """A copy of the good adapter with ``edit(config dict, dir)`` applied."""
    d = eng.root / ("allowed" if inside else "outside") / name
    if d.exists():
        return d
    shutil.copytree(eng.root / "allowed" / "ad", d)
    if edit is not None:
        cfg = json.loads((d / "adapter_config.json").read_text())
        edit(cfg, d)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
    return d


def retensor(d: Path, fn: Any) -> None:
    from safetensors.torch import load_file, save_file

    f = d / "adapter_model.safetensors"
    save_file(fn(load_file(str(f))), str(f))


def test_bad_adapters_and_bodies_are_one_4xx_each_and_load_nothing(eng: Lora) -> None:
    def setv(**kv: Any) -> Any:
        return lambda cfg, d: cfg.update(kv)

    other = eng.root / "other-model"
    cases: list[tuple[Any, int, str]] = [
        (variant(eng, "other-base", setv(base_model_name_or_path=str(other))), 400, "base model"),
        (variant(eng, "no-base", setv(base_model_name_or_path=None)), 400, "base model"),
        (variant(eng, "bad-target", setv(target_modules=["c_attn", "q_proj"])), 400, "['c_attn']"),
        (variant(eng, "regex-target", setv(target_modules=".*proj")), 400, "target_modules"),
        (variant(eng, "rank", setv(r=8)), 400, "expected [8,"),
        (variant(eng, "rank0", setv(r=0)), 400, "r must be"),
        (variant(eng, "alpha", setv(lora_alpha=-1)), 400, "lora_alpha"),
        (variant(eng, "dora", setv(use_dora=True)), 400, "use_dora"),
        (variant(eng, "prompt", setv(peft_type="PROMPT_TUNING")), 400, "peft_type"),
        (variant(eng, "absent-layer", lambda c, d: retensor(d, lambda t: {
            k.replace("layers.0.", "layers.99."): v for k, v in t.items()})), 400, "does not have"),
        (variant(eng, "half", lambda c, d: retensor(d, lambda t: {
            k: v for k, v in t.items() if k != "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"})),
         400, "lora_B missing"),
        (variant(eng, "shape", lambda c, d: retensor(d, lambda t: {
            k: (v[:, :-1].contiguous() if k.endswith("q_proj.lora_B.weight") else v) for k, v in t.items()})),
         400, "has shape"),
        (variant(eng, "strange-name", lambda c, d: retensor(d, lambda t: {
            (k.replace("model.layers.0.mlp.up_proj.lora_A", "lm_head") if "layers.0.mlp.up" in k else k): v
            for k, v in t.items()})),
         400, "not a PEFT LoRA tensor name"),
        (variant(eng, "no-weights", lambda c, d: (d / "adapter_model.safetensors").unlink()), 400, "safetensors"),
        (str(eng.root / "allowed" / "missing"), 400, "not a directory"),
    ]
    for path, status, words in cases:
        r = eng.post("/load_lora_adapter", {"lora_name": "bad", "lora_path": str(path)})
        assert r.status_code == status and words in r.json()["error_message"], (path, r.text)
        assert r.json()["success"] is False
    # confined like /update_weights_from_disk: 403, the same answer whatever the path
    (eng.root / "outside").mkdir(exist_ok=True)
    outside = variant(eng, "ad", inside=False)
    (eng.root / "allowed" / "escape").symlink_to(outside)
    for path in (outside, eng.root / "allowed" / ".." / "outside" / "ad", eng.root / "allowed" / "escape",
                 eng.root / "outside" / "nothing", "/etc", "x\x00y"):
        r = eng.post("/load_lora_adapter", {"lora_name": "bad", "lora_path": str(path)})
        assert r.status_code == 403 and "outside the directories" in r.json()["error_message"], (path, r.text)
        assert str(eng.root) not in r.text
    # bodies
    for body in ({"lora_path": "x"}, {"lora_name": "", "lora_path": "x"}, {"lora_name": 7, "lora_path": "x"},
                 {"lora_name": "a"}, {"lora_name": "a", "lora_path": 3}, {"lora_name": "a", "lora_path": "x", "zz": 1},
                 {"lora_name": "a", "lora_path": "x", "pinned": "yes"}, [1]):
        r = eng.post("/load_lora_adapter", body)
        assert r.status_code == 400 and "load_lora_adapter:" in r.json()["error_message"], (body, r.text)
    for body in ({}, {"lora_name": ["a"]}, {"lora_name": "a", "lora_path": "x"}):
        assert eng.post("/unload_lora_adapter", body).status_code == 400, body
    r = httpx.post(f"{eng.url}/load_lora_adapter", content=b"{not json", headers=AUTH, timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error_message"]
    big = {"lora_name": "a", "lora_path": "x" * (2 << 20)}
    assert eng.post("/load_lora_adapter", big).status_code == 413
    # authenticated like every endpoint
    for path in ("/load_lora_adapter", "/unload_lora_adapter"):
        assert httpx.post(f"{eng.url}{path}", json={"lora_name": "a", "lora_path": "x"}, timeout=30).status_code == 401
    assert eng.loaded() == {}
    # a duplicate name: 400, the first stays; an unknown name in /generate: 400 naming it
    good = str(eng.root / "allowed" / "ad")
    assert eng.post("/load_lora_adapter", {"lora_name": "dup", "lora_path": good}).status_code == 200
    r = eng.post("/load_lora_adapter", {"lora_name": "dup", "lora_path": str(variant(eng, "rank"))})
    assert r.status_code == 400 and "already loaded" in r.json()["error_message"]
    assert eng.loaded() == {"dup": good}
    sp = {"max_new_tokens": 2}
    for lora, words in (("nope", "not loaded: nope"), (["dup"], "list of 1 but there are 2"), (7, "lora_path"),
                        (["dup", ""], "lora_path[1]")):
        r = eng.post("/generate", {"input_ids": [prompt_ids(1), prompt_ids(2)], "lora_path": lora, "sampling_params": sp})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (lora, r.text)
    assert eng.post("/unload_lora_adapter", {"lora_name": "dup"}).status_code == 200
    assert eng.proc.alive() and eng.loaded() == {}
