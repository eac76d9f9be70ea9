"""The unit the passes schedule, preempt and seat: a request, or a beam group's beams, which
sit next to each other in one queue and move together."""

from __future__ import annotations

from collections.abc import Iterable

from control_plane.beam import BeamGroup
from control_plane.request import Request


def group_of(req: Request) -> BeamGroup | None:
    """The beam group `req` is a beam of. `Request.beam` is typed by the `SequenceGroup`
    protocol alone, as request.py does not import beam.py."""
    group = req.beam
    assert group is None or isinstance(group, BeamGroup), f"{req.req_id}: not a beam group"
    return group


def seats_asked(req: Request) -> int:
    """Seats a request not running needs to start: its beam width, or n."""
    group = group_of(req)
    return group.width if group is not None else req.sampling.n


def running_seats(running: Iterable[Request]) -> int:
    """Seats the running requests hold: a fork parent n (its children's), a beam group its
    width, whether it has widened to width beams yet or not."""
    seats = 0
    for r in running:
        group = group_of(r)
        if group is None:
            seats += r.sampling.n
        else:
            seats += 1 if len(group.beams) > 1 else group.width
    return seats


def pop_newest(running: list[Request]) -> list[Request]:
    """Takes the newest running unit off the running queue: a request, or a whole beam group
    (its beams are the last ones)."""
    victim = running.pop()
    group = group_of(victim)
    if group is None:
        return [victim]
    n = len(group.beams)
    beams = running[len(running) - n + 1 :]
    del running[len(running) - n + 1 :]
    return [*beams, victim]
