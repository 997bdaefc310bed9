"""The poison of a failed step, shared by every optimizer whose state streams
(``StreamingAdam``, ``StreamingMuon`` and greenroom.megatron's ``StreamingDistributedOptimizer``).

Note [a failed step poisons]: a step that raises part way (an I/O error writing bucket 3,
a flipped bit found in bucket 5) has updated some buckets, counters and params and not
others, and which is not recorded anywhere; a bucket whose write-back failed may even
read back as its pre-step bytes, checksums and all. Stepping on from there trains a
state no run without the fault would reach, silently. So the first failure is kept, and
every later step, state dict and checkpoint save raises one line naming it, until the
whole state is replaced (a checkpoint loaded, or a fresh state initialized). A load that
fails after it began to replace the state (a bucket file that cannot be copied, a
resident state that does not fit) poisons the same way: some buckets hold the
checkpoint's bytes and some the run's.
"""

from __future__ import annotations

import contextlib

from greenroom.errors import GreenroomError, one_line


class FailedStepPoison:
    """A mixin: ``what`` names the optimizer (the first word of its messages) and
    ``reload_with`` the calls that replace its whole state."""

    what = "optimizer"
    reload_with = "load_checkpoint or load_state_dict"
    _failed: str | None = None  # the first failure and what it left, one line; None: healthy

    def _refuse_if_failed(self, call: str) -> None:
        """See Note [a failed step poisons]."""
        if self._failed is not None:
            raise GreenroomError(
                f"{self.what}: {call} refused: an earlier {self._failed}; load a checkpoint ({self.reload_with}) "
                "before stepping or saving again"
            )

    @contextlib.contextmanager
    def _poisoned_if_it_fails(
        self, call: str = "step()", left: str = "partly updated (some buckets stepped, some not)"
    ):
        """Around the part of ``call`` that changes state: what raises out of it poisons."""
        try:
            yield
        except BaseException as e:
            self._failed = f"{call} failed ({one_line(e)}) and left the state {left}"
            raise

    def _state_replaced(self) -> None:
        """The whole state was just replaced (loaded or initialized): no poison left."""
        self._failed = None
