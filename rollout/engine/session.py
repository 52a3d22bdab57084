"""The engine's weight-update session: SGLang 0.5.23's rules for the weight-update endpoints, in
one state machine that every endpoint calls (the reference engine's and the standalone receiver's).

Two parts of state, both guarded by one lock:
- the group: none, being joined (``/init_weights_update_group`` blocks on the rendezvous), or
  joined under a name. One group at a time.
- the session:

  ======== ============================ ================================================
  state    meaning                      transitions
  ======== ============================ ================================================
  idle     no session; generation runs  begin -> open
  open     buckets may come; no step    bucket -> receiving; end -> idle (200)
  receiving a bucket is received/loaded (done) -> open, or failed if it did not load
  failed   a bucket failed: partial     end -> idle (400 naming the failure)
  ======== ============================ ================================================

  Anything else is refused with a message saying what to call instead: a bucket outside a session,
  during another bucket, after a failed bucket, or for another group; begin inside a session; end
  without one or during a bucket; destroy of a group that is not there. Destroying the group
  inside a session is allowed (a sender that failed tears down its group and reconnects; SGLang
  allows it too). A destroy during a bucket gives that bucket's receive up first (only rank 0,
  the sender, destroys: the data it would wait for will not come; gloo does not always notice a
  sender killed in mid-broadcast, ``rollout.engine.receiver``), the bucket fails (the weights are
  partial), then the group goes; a receive that does not end within ``destroy_wait_s`` (a
  receiver that cannot be given up) still refuses the destroy.

Guarantees: the target generates nothing while a session is open (``target.set_updating``); the
target's weight version changes only with a bucket that carries one and loaded completely (the
sender puts it on the last bucket); after a failed bucket ``broken`` says why until a session ends
cleanly or the whole model is loaded from disk, and the reference engine refuses to generate
while it is set: a partial update is an error, never silently served.
"""

from __future__ import annotations

import enum
import threading
from typing import Any, Protocol

import torch

from headrace.rollout.engine.receiver import WeightReceiver
from headrace.shared.weight_sync.protocol import DestroyGroupRequest, InitGroupRequest, UpdateBucketRequest

__all__ = ["State", "SessionError", "WeightTarget", "UpdateSession"]


class State(enum.Enum):
    IDLE = "idle"
    OPEN = "open"
    RECEIVING = "receiving"
    FAILED = "failed"


class SessionError(ValueError):
    """A request the session refuses, or an update that failed; the message is the answer."""


class WeightTarget(Protocol):
    """What the session drives: the engine's model. Every method may block (the caller is a worker
    thread); ``load`` must copy what it keeps (tensors may be views of one receive buffer)."""

    def set_updating(self, updating: bool) -> None:
        """Stop (True) or allow (False) generation; returns once in effect."""

    def param_view(self, name: str) -> torch.Tensor | None:
        """The model's own tensor for ``name`` to receive into (per-tensor mode), or None."""

    def load(self, named: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        """Copy the tensors in, then set the weight version when one is given."""

    def abort_all(self, reason: str) -> None: ...

    def flush_cache(self) -> None: ...


class UpdateSession:
    """The weight-update group and session of one engine (see the module docstring)."""

    def __init__(self, target: WeightTarget, *, timeout_s: float = 300.0, receiver: Any = None,
                 destroy_wait_s: float = 5.0) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.receiver = receiver if receiver is not None else WeightReceiver()
        self.destroy_wait_s = destroy_wait_s
        self.state = State.IDLE
        self.group: str | None = None       # the joined group's name
        self.joining: str | None = None     # the name of a group being joined
        self.broken: str | None = None      # why the weights are partial, after a failed bucket
        self._cond = threading.Condition()
        self._give_up = threading.Event()   # set by a destroy: the running receive ends

    # -- the group --

    def init_group(self, req: InitGroupRequest) -> str:
        with self._cond:
            if self.group is not None or self.joining is not None:
                raise SessionError(f"a weight update group ({self.group or self.joining}) already exists; "
                                   "destroy it first")
            self.joining = req.group_name
        try:
            self.receiver.init_group(req.master_address, req.master_port, req.rank_offset, req.world_size,
                                     req.group_name, req.backend, self.timeout_s)
        except Exception as e:  # noqa: BLE001 - answered to the caller
            with self._cond:
                self.joining = None
            raise SessionError(f"Failed to init process group {req.group_name}: {e}") from e
        with self._cond:
            self.group, self.joining = req.group_name, None
        return "Succeeded to initialize custom process group."

    def destroy_group(self, req: DestroyGroupRequest) -> str:
        with self._cond:
            if self.group is None or req.group_name != self.group:
                raise SessionError(f"no weight update group named {req.group_name!r}")
            if self.state is State.RECEIVING:
                self._give_up.set()
            if not self._cond.wait_for(lambda: self.state is not State.RECEIVING, self.destroy_wait_s):
                raise SessionError(f"a bucket from group {self.group!r} is being received; destroy the group "
                                   "after its answer (the receive ends once rank 0 leaves the group, or at "
                                   "the group timeout)")
            self.group = None
            try:
                self.receiver.destroy()
            except Exception as e:  # noqa: BLE001
                raise SessionError(f"destroying group {req.group_name} failed: {e}") from e
        return f"Succeeded to destroy process group {req.group_name}."

    # -- the session --

    def begin(self) -> str:
        with self._cond:
            if self.state is not State.IDLE:
                raise SessionError("a weight update session is already open; call /end_weight_update first")
            self.target.set_updating(True)
            self.state = State.OPEN
        return "Weight update session started."

    def bucket(self, req: UpdateBucketRequest) -> str:
        with self._cond:
            if self.state is State.IDLE:
                raise SessionError("update_weights_from_distributed outside a weight update session: "
                                   "call /begin_weight_update first")
            if self.state is State.RECEIVING:
                raise SessionError("a bucket is already being received: send the next one after its answer")
            if self.state is State.FAILED:
                raise SessionError(f"an earlier bucket of this session failed ({self.broken}): call "
                                   "/end_weight_update and push a whole update again")
            if self.group is None or req.group_name != self.group:
                raise SessionError(f"no weight update group named {req.group_name!r}: call "
                                   "/init_weights_update_group first")
            self.state = State.RECEIVING
            self._give_up.clear()
        error = "interrupted"
        try:
            if req.abort_all_requests:
                self.target.abort_all("Abort by update_weights_from_distributed")
            # per-tensor broadcasts may land straight in the model's parameters: no decoding runs
            # inside a session, and a failed update leaves the weights marked partial anyway
            named = self.receiver.receive(req.names, req.dtypes, req.shapes, req.load_format,
                                          dest=self.target.param_view, cancelled=self._give_up.is_set)
            self.target.load(named, req.weight_version)
            error = ""
        except Exception as e:  # noqa: BLE001 - the update failed: answered, and the weights are partial
            error = f"{type(e).__name__}: {e}"
        finally:
            with self._cond:
                self.state = State.FAILED if error else State.OPEN
                if error:
                    self.broken = error
                self._cond.notify_all()
        if error:
            raise SessionError(f"Failed to update parameter online: {error}. The weights are partially "
                               "updated; end the session and push a whole update again.")
        if req.flush_cache:
            self.target.flush_cache()
        message = "Succeeded to update parameter online."
        if req.weight_version is not None:
            message += f" Weight version updated to {req.weight_version}."
        return message

    def end(self) -> str:
        with self._cond:
            if self.state is State.IDLE:
                raise SessionError("no weight update session is open (call /begin_weight_update first)")
            if self.state is State.RECEIVING:
                raise SessionError("a bucket is being received: end the session after its answer")
            self.target.set_updating(False)
            failed, self.state = self.state is State.FAILED, State.IDLE
            if failed:
                raise SessionError(f"the session had a failed update: {self.broken}")
            self.broken = None
        return "Weight update session ended."

    def whole_model_loaded(self) -> None:
        """Every weight was just replaced (a disk load): the weights are no longer partial."""
        with self._cond:
            self.broken = None
