"""The ledger of a correlated-noise run (banded MF, BLT): one event per step, equal but for its ``segment`` (the piece
of the run since the noise stream last restarted, docs/design.md section 5.1), segments in order; each segment of
``n_i`` steps lets one example take part at most ``ceil(n_i / b)`` times."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

from lightning_dp.accounting.base import Accountant
from lightning_dp.correlated_noise.sensitivity import participation_count


class SegmentedAccountant(Accountant):
    """An accountant of one correlated-noise run's steps (subclasses set the event type and the messages).

    Attributes:
        event_type: the events it composes (frozen dataclasses with ``num_groups`` and ``segment``).
        label: the mechanism's name in messages (``"banded MF"``).
        keep: what a run must keep fixed, in messages (``"sigma, q_b, b and C"``).
    """

    event_type: ClassVar[type[Any]]
    label: ClassVar[str]
    keep: ClassVar[str]

    @abc.abstractmethod
    def validate(self, event: Any) -> None:
        """Raise ``ValueError`` (one line saying what to change) unless ``event``'s parameters are valid."""

    def supports(self, event: Any) -> bool:
        return isinstance(event, self.event_type)

    def compose(self, event: Any, count: int = 1) -> Accountant:
        """Record ``count`` steps of ``event``.

        Raises:
            ValueError: another event type, invalid parameters, an event that differs from the ledger's in more than
                its segment (the bound needs the same parameters for the whole run), or a segment below the ledger's
                last.
        """
        if isinstance(event, self.event_type) and count > 0:
            self.validate(event)
            last = self.ledger[-1][0] if self.ledger else None
            if last is not None and dataclasses.replace(last, segment=event.segment) != event:
                raise ValueError(
                    f"{self.label} accounting needs the same parameters at every step; the ledger has {last!r}, got "
                    f"{event!r}: keep {self.keep} fixed for the run"
                )
            if last is not None and event.segment < last.segment:
                raise ValueError(
                    f"{self.label} segments come in order: the ledger is at segment {last.segment}, got {event.segment}"
                )
        return super().compose(event, count)

    def segment_steps(self) -> list[int]:
        """The steps ``n_i`` of each segment, in order."""
        steps: dict[int, int] = {}
        for event, count in self.ledger:
            steps[event.segment] = steps.get(event.segment, 0) + count
        return list(steps.values())

    @property
    def participations(self) -> int:
        """``k``, the most steps one example can take part in so far (0 for an empty ledger): per segment of ``n_i``
        steps ``ceil(n_i / b)`` (group ``g`` is eligible at the ``ceil((n_i - g) / b)`` steps ``t = g mod b``, most for
        ``g = 0``), summed over the segments."""
        if not self.ledger:
            return 0
        return sum(participation_count(n, self.ledger[0][0].num_groups) for n in self.segment_steps())
