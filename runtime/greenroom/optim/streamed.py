"""What every streaming optimizer (``StreamingAdam``, ``StreamingMuon``) does the same way
around its state, whatever its update rule.

Note [a failed step poisons]: a step that raises part way (an I/O error writing bucket 3,
a flipped bit found in bucket 5) has updated some buckets, counters and params and not
others, and which is not recorded anywhere; a bucket whose write-back failed may even
read back as its pre-step bytes, checksums and all. Stepping on from there trains a
state no run without the fault would reach, silently. So the first failure is kept, and
every later ``step()``, ``state_dict()`` and ``save_checkpoint()`` raises one line naming
it, until the whole state is replaced: ``load_checkpoint``, ``load_state_dict`` or
``initialize_state``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from greenroom.errors import GreenroomError


class StreamedOptimizer(torch.optim.Optimizer):
    """The shared part of the streaming optimizers: the poison of a failed step, and
    torch's state-dict hooks around a format of the subclass's own. A subclass sets ``self._failed = None`` before ``torch.optim.Optimizer.__init__`` and
    names itself in ``what`` (the messages' first word)."""

    what = "StreamedOptimizer"
    _failed: str | None

    def _refuse_if_failed(self, call: str) -> None:
        """See Note [a failed step poisons]."""
        if self._failed is not None:
            raise GreenroomError(
                f"{self.what}: {call} refused: an earlier step() failed ({self._failed}) and left the state "
                "partly updated (some buckets stepped, some not); load a checkpoint (load_checkpoint or "
                "load_state_dict) before stepping or saving again")

    @contextlib.contextmanager
    def _poisoned_if_it_fails(self):
        """Around the part of a step that changes state: what raises out of it poisons."""
        try:
            yield
        except BaseException as e:
            self._failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            raise

    def _state_replaced(self) -> None:
        """The whole state was just replaced (loaded or initialized): no poison left."""
        self._failed = None

    def _hooked_state_dict(self, export: Callable[[Any], dict]) -> dict:
        """``export(self)`` between the hooks torch's ``Optimizer.state_dict`` runs (a
        post hook may return a replacement); refused while poisoned."""
        self._refuse_if_failed("state_dict()")
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        out = export(self)
        for hook in self._optimizer_state_dict_post_hooks.values():
            hooked = hook(self, out)
            if hooked is not None:
                out = hooked
        return out

    def _hooked_load_state_dict(self, state_dict: dict, load: Callable[[Any, dict], None]) -> None:
        """``load(self, state_dict)`` between the hooks torch's ``Optimizer.load_state_dict``
        runs (a pre hook may return a replacement dict); it replaces the whole state."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            hooked = hook(self, state_dict)
            if hooked is not None:
                state_dict = hooked
        load(self, state_dict)
        self._state_replaced()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
