"""The trainer's view of one or several rollout services (scale-out: each feeds the same buffer with
its own ``rollout.data.shard``), behind the interface of one ``RolloutClient``.

``EngineControl`` calls the same methods whether it drives one service or k of them:
- ``pause``, ``resume``, ``release_memory``, ``resume_memory``, ``load_adapter`` go to every
  service, concurrently; when any fails, the others still get the call and one ``RolloutError``
  names each failing service and what it answered (its URL is in the message);
- ``engines()`` is every service's engines, in service order, so one weight-sync group covers them
  all (rank offsets continue across services); an engine listed by two services is an error
  naming both; ``service_of(engine_url)`` says which service an engine belongs to, for errors;
- ``status()`` merges the services' ``engines`` (each tagged with its ``service``);
- ``generate_batch(n)`` (on-demand) splits ``n`` groups over the services in proportion to their
  engines at the last ``engines()`` listing (made first if there was none), so that services with
  unequal blocks of engines finish together, and a step still gets ``n`` groups (largest
  remainders, ties to the lower index; services listing no engine get none unless none lists any,
  then the split is even);
- ``check_layout()`` (at the trainer's start, k > 1) reads every service's ``/v1/status`` and
  refuses services that draw the same prompts (equal data fingerprints) without disjoint shards of
  one count and one weights list (``layout_problems``: a service with no shard, or ``split:
  false``, next to one with a shard, different counts or weights, one index twice) and services
  over different data whose group ids would collide (one ``run_id``, the same key prefix), each
  error naming the services and the key; it warns of shards no service of this trainer draws and
  of admission shares that do not sum to the cap (e.g. unsharded services over different data,
  each admitting against the whole cap, where ``split: false`` shards would split it);
- ``evaluate`` splits the held-out prompts over the services (prompts i, i + k, ... to service i:
  every service holds all of them, since sharding splits only the training prompts, and the
  weights are one version everywhere), so every engine takes part; the answer is the whole set's
  (``n`` summed, ``score`` and ``reward_mean`` weighted by each part's ``n``, ``failed`` summed,
  ``weight_version`` the oldest).
With one service every call goes straight to its client.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from headrace.shared.rollout_client import RolloutClient, RolloutError
from headrace.shared.staleness import split_by_weights
from headrace.shared.weight_sync.protocol import EngineTarget

log = logging.getLogger("headrace.trainer.rollout")


class RolloutServices:
    """Every rollout service the trainer controls (see the module docstring)."""

    def __init__(self, urls: Sequence[str], *, timeout: float = 600.0, token: str | None = None) -> None:
        cleaned = [u.rstrip("/") for u in urls]
        if not cleaned:
            raise ValueError("at least one rollout URL is needed")
        dup = sorted({u for u in cleaned if cleaned.count(u) > 1})
        if dup:
            raise ValueError(f"rollout URL(s) given twice: {', '.join(dup)}")
        self.urls = cleaned
        self.clients = [RolloutClient(u, timeout=timeout, token=token) for u in cleaned]
        self._pool = ThreadPoolExecutor(len(cleaned), "rollout-fanout") if len(cleaned) > 1 else None
        self._service_of: dict[str, str] = {}
        self._engine_counts: list[int] | None = None   # engines per service at the last engines()

    def _each(self, what: str, call: Callable[[RolloutClient, int], Any]) -> list[Any]:
        """``call(client, index)`` for every service, concurrently; the answers in service order."""
        if self._pool is None:
            return [call(self.clients[0], 0)]
        futures = [self._pool.submit(call, c, i) for i, c in enumerate(self.clients)]
        answers, failed = [], []
        for url, f in zip(self.urls, futures):
            try:
                answers.append(f.result())
            except Exception as e:           # every service is waited for before the error is raised
                failed.append(f"rollout service {url}: {e}")
        if failed:
            raise RolloutError(f"{what} failed on {len(failed)} of {len(self.urls)} rollout services: "
                               + "; ".join(failed))
        return answers

    def check_layout(self) -> None:
        """Refuse services whose prompt shards collide; warn of gaps and of admission shares that do
        not add up (see the module docstring). A service that does not answer is left to the calls
        that need it."""
        if len(self.clients) == 1:
            return
        try:
            statuses = self._each("status", lambda c, i: c.status())
        except RolloutError as e:
            log.warning("could not check the rollout services' shards: %s", e)
            return
        errors, warnings = layout_problems(self.urls, statuses)
        for w in warnings:
            log.warning("%s", w)
        if errors:
            raise RolloutError("; ".join(errors))

    def status(self) -> dict[str, Any]:
        answers = self._each("status", lambda c, i: c.status())
        if len(answers) == 1:
            return answers[0]
        engines = [{**e, "service": url} for url, a in zip(self.urls, answers) for e in a.get("engines", [])]
        return {"services": dict(zip(self.urls, answers)), "engines": engines}

    def engines(self) -> list[EngineTarget]:
        out: list[EngineTarget] = []
        owner: dict[str, str] = {}
        for url, engines in zip(self.urls, self._each("engines", lambda c, i: c.engines())):
            for e in engines:
                if e.url in owner:
                    raise RolloutError(f"engine {e.url} is listed by rollout services {owner[e.url]} and {url}: "
                                       "each engine must belong to one service")
                owner[e.url] = url
                out.append(e)
        self._service_of = owner
        self._engine_counts = [sum(1 for u in owner.values() if u == url) for url in self.urls]
        return out

    def service_of(self, engine_url: str) -> str | None:
        """The rollout service that listed ``engine_url`` at the last ``engines()`` call."""
        return self._service_of.get(engine_url.rstrip("/"))

    def pause(self, mode: str = "abort") -> dict[str, Any]:
        return self._merge(self._each("pause", lambda c, i: c.pause(mode)))

    def resume(self, weight_version: int) -> dict[str, Any]:
        return self._merge(self._each("resume", lambda c, i: c.resume(weight_version)))

    def release_memory(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._merge(self._each("release_memory", lambda c, i: c.release_memory(tags)))

    def resume_memory(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._merge(self._each("resume_memory", lambda c, i: c.resume_memory(tags)))

    def load_adapter(self, path: str, weight_version: int) -> dict[str, Any]:
        answers = self._each("load_adapter", lambda c, i: c.load_adapter(path, weight_version))
        if len(answers) == 1:
            return answers[0]
        return {"engines": sum(int((a or {}).get("engines", 0)) for a in answers), "services": answers}

    def generate_batch(self, groups: int, weight_version: int | None = None) -> dict[str, Any]:
        if len(self.clients) == 1:
            return self.clients[0].generate_batch(groups, weight_version)
        if self._engine_counts is None:
            self.engines()   # sets them
        shares = split_groups(groups, self._engine_counts or [1] * len(self.clients))
        return self._merge(self._each("generate_batch",
                                      lambda c, i: c.generate_batch(shares[i], weight_version) if shares[i] else {}))

    def evaluate(self, n: int | None = None) -> dict[str, Any]:
        k = len(self.clients)
        if k == 1:
            return self.clients[0].evaluate(n)
        return merge_evaluations(self._each("evaluate", lambda c, i: c.evaluate(n, (i, k))))

    def _merge(self, answers: list[Any]) -> dict[str, Any]:
        return answers[0] if len(answers) == 1 else {"services": dict(zip(self.urls, answers))}

    def close(self) -> None:
        for c in self.clients:
            c.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def merge_evaluations(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The evaluation of the whole held-out set from its parts' answers (see the module docstring)."""
    n = sum(int(p["n"]) for p in parts)
    scored = [p for p in parts if int(p["n"]) > 0]

    def mean(key: str) -> float:
        return sum(float(p[key]) * int(p["n"]) for p in scored) / n if n else 0.0

    score = mean("score")
    return {"n": n, "score": score, "pass_at_1": score, "reward_mean": mean("reward_mean"),
            "failed": sum(int(p.get("failed", 0)) for p in parts),
            "weight_version": min((p["weight_version"] for p in scored), default=parts[0].get("weight_version")),
            "parts": len(parts)}


def layout_problems(urls: Sequence[str], statuses: Sequence[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(errors, warnings) of several services' prompt shards and admission shares, from their
    ``/v1/status`` answers (see the module docstring)."""
    errors: list[str] = []
    warnings: list[str] = []
    same: dict[str, list[tuple[str, tuple[int, int] | None]]] = {}
    weights: dict[str, Any] = {}   # by service: its shard's weights (None: even shares)
    ids: dict[tuple[str, str], list[tuple[str, str]]] = {}   # (run_id, key prefix) -> [(service, fingerprint)]
    for url, st in zip(urls, statuses):
        data = st.get("data") or {}
        shard = data.get("shard")
        own = bool(shard) and shard.get("split") is False   # draws all of its own prompts (admission share only)
        if data.get("fingerprint"):
            same.setdefault(data["fingerprint"], []).append(
                (url, (int(shard["index"]), int(shard["count"])) if shard and not own else None))
            if shard and not own:
                weights[url] = shard.get("weights")
            if st.get("run_id"):
                tag = f"s{shard['index']}of{shard['count']}" if own else ""
                ids.setdefault((str(st["run_id"]), tag), []).append((url, data["fingerprint"]))
    for group in same.values():
        if len(group) < 2:
            continue
        loose = [u for u, sh in group if sh is None]
        counts = sorted({sh[1] for _, sh in group if sh is not None})
        if loose:
            errors.append(f"rollout services {', '.join(u for u, _ in group)} draw the same prompts (same data, seed "
                          f"and shuffle) but {', '.join(loose)} {'has' if len(loose) == 1 else 'have'} no "
                          "rollout.data.shard (or one with split: false), so prompts would be generated twice; "
                          f"give each service its own shard {{index: i, count: {len(group)}}}")
            continue
        if len(counts) > 1:
            errors.append(f"rollout services {', '.join(f'{u} (count {sh[1]})' for u, sh in group if sh)} shard the "
                          "same prompts with different rollout.data.shard.count: give every one the same count")
            continue
        lists = {json.dumps(weights.get(u)) for u, _ in group}
        if len(lists) > 1:
            named = ", ".join(f"{u} ({weights.get(u) or 'even'})" for u, _ in group)
            errors.append(f"rollout services {named} shard the same prompts with different "
                          "rollout.data.shard.weights: give every one the same list (or none), or their admission "
                          "shares do not add up to the cap")
            continue
        count, owners = counts[0], {}
        for u, sh in group:
            if sh is not None and sh[0] in owners:
                errors.append(f"rollout services {owners[sh[0]]} and {u} both draw shard {sh[0]} of {count} of the "
                              f"same prompts: give each its own rollout.data.shard.index (0..{count - 1})")
            elif sh is not None:
                owners[sh[0]] = u
        missing = sorted(set(range(count)) - set(owners))
        if missing and not errors:
            warnings.append(f"shard(s) {missing} of {count} of the prompts are drawn by none of this trainer's "
                            f"rollout services ({', '.join(owners.values())}): those prompts are trained on only "
                            "if another service draws them, and its engines are not synced by this trainer")
    for (run_id, _), members in ids.items():   # the same prompts twice are refused above; here other data
        clash = [(a, b) for i, (a, fa) in enumerate(members) for b, fb in members[i + 1:] if fa != fb]
        for a, b in clash:
            errors.append(f"rollout services {a} and {b} draw different prompts under the same run_id {run_id!r}: "
                          "their group ids (<run_id>-e<epoch>-g<position>) would collide and the buffer would keep "
                          "only one group of each pair; give each its own rollout.state_path (its cursor file, from which "
                          "the default run_id comes) and run_id, or rollout.data.shard {index: i, count: k, split: "
                          "false}, which keeps both apart")
    live = [st for st in statuses if st.get("mode") == "continuous" and "admission_share" in st]
    caps = {st.get("admission_cap") for st in live}
    if len(live) > 1 and len(caps) == 1:
        cap, total = caps.pop(), sum(int(st["admission_share"]) for st in live)
        if cap is not None and cap >= len(live) and total != cap:
            warnings.append(f"the continuous rollout services' admission shares sum to {total}, not the cap {cap}: "
                            f"up to ~{cap + total} groups may be ahead of the trainer (services without "
                            "rollout.data.shard each admit against the whole cap; give every service the same "
                            "shard count and weights, with split: false where their data differ)")
    return errors, warnings


def split_groups(groups: int, weights: Sequence[int]) -> list[int]:
    """``groups`` split in proportion to ``weights`` (largest remainders, ties to the lower index);
    an even split when every weight is 0."""
    return split_by_weights(groups, list(weights) if any(weights) else [1] * len(weights))
