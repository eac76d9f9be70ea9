"""What a scheduler holds between steps, shared by the modules of this package: its three
queues, its unfinished requests, what the worker knows of them, and the counters behind
`stats()`; with the moves of a request between queues that keep them consistent.

    add_request ──▶ waiting ──admit──▶ running ──swap out──▶ swapped
                       ▲                 │ ▲                   │
                       └── recompute ────┘ └──── swap in ──────┘
    finish (from any queue): its blocks freed, the worker told when it knew the request
"""

from __future__ import annotations

from collections import deque
from collections.abc import MutableSequence
from dataclasses import dataclass, field

from control_plane.block_manager import BlockManager
from control_plane.request import Request, RequestStatus
from control_plane.scheduler.config import SchedulerConfig
from pagedserve.plan import StepPlan


@dataclass(frozen=True)
class InFlight:
    """A plan awaiting update(): the requests it scheduled, and the ids of those due to sample."""

    plan: StepPlan
    requests: dict[str, Request]
    sampling: frozenset[str]


@dataclass
class Counters:
    num_steps: int = 0
    preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    chunked_prefill_steps: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    computed_tokens: int = 0
    prompt_tokens: int = 0
    forks: int = 0
    copied_blocks: int = 0
    peak_used_gpu_blocks: int = 0


class SchedulerState:
    """A scheduler's queues and records over one worker's block pool.

    Requests the worker knows are exactly the RUNNING ones except forked children not yet
    scheduled (`unsent`). Every other request is sent in full (`NewRequestData`) when it is
    next scheduled; a request the worker knows that stops running is listed in
    finished_req_ids: of the plan that preempts it, or of the next plan when it finishes, is
    aborted or forks. A fork parent takes n of the max_num_seqs seats, as its children will.

    Outside this package, read the state through `Scheduler`'s methods; only `waiting`,
    `running` and `swapped` are meant to be looked at directly.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}  # unfinished requests
        self.unsent: set[str] = set()  # running, but new to the worker
        self.children: dict[str, list[str]] = {}  # forked parent -> its unfinished children
        self.finished_to_drop: list[str] = []  # the worker's state for these is stale
        self.next_step_id = 0
        self.in_flight: deque[InFlight] = deque()  # plans with tokens, not yet updated
        self.counters = Counters()

    def queue_of(self, status: RequestStatus) -> MutableSequence[Request]:
        """The queue of requests with this (unfinished) status."""
        return {
            RequestStatus.RUNNING: self.running,
            RequestStatus.WAITING: self.waiting,
            RequestStatus.SWAPPED: self.swapped,
        }[status]

    def start_running(self, req: Request) -> None:
        """A waiting or swapped request joins the running ones; the worker does not know it."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self.unsent.add(req.req_id)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Takes an unfinished request out of its queue and frees its blocks."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            if req.req_id in self.unsent:
                self.unsent.remove(req.req_id)
            else:
                self.finished_to_drop.append(req.req_id)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.swapped.remove(req)
        self.block_manager.free(req.req_id)
        req.status = status
        del self.requests[req.req_id]
        if req.parent_id is not None and (siblings := self.children.get(req.parent_id)):
            siblings.remove(req.req_id)
            if not siblings:
                del self.children[req.parent_id]

    def live_requests(self, req_id: str) -> list[Request]:
        """The unfinished requests answering for a client's request id: the request itself,
        or a forked parent's unfinished children in index order; [] when all finished."""
        req = self.requests.get(req_id)
        if req is not None:
            return [req]
        return [self.requests[c] for c in self.children.get(req_id, ())]
