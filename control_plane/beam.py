"""Beam search over shared KV blocks: a group of beams that the scheduler runs as one unit.

A request with `sampling.beam_width` W becomes a `BeamGroup` whose beams are requests of its
own (`<id>#b<slot>`, children of the client's id). Each step of the group computes one token
per live beam, and every beam row returns its best candidates (token id, float32 log-softmax)
instead of sampling; `BeamGroup.select` then decides, exactly as transformers'
`generate(num_beams=W, do_sample=False)`:

    candidates = every (beam, token): running score of the beam + log p(token | beam)
    top        = the best K of them, K = max(2, 1 + number of EOS ids) x W
    finished   = those of the first W of top that end in EOS, or reach max_new_tokens, scored
                 sum / generated_length ** length_penalty, merged into the best W finished
    next beams = the best W of top that did not finish
    stop       = W finished and (early_stopping is True, or no running beam can beat the
                 worst finished one by the heuristic of early_stopping False / "never"), or
                 every candidate of top finished (max_new_tokens)

Scores are float32 sums, as transformers keeps them. The group starts from one beam (the
prompt), as transformers' other W - 1 initial beams score -1e9 and never reach the top.

The next beams reuse the slots: slot i's request takes the tokens, blocks (`BlockManager.
reassign`: refcounts up, unselected tables released) and KV of the beam it extends, plus the
selected token; the worker learns it from a `BeamFork` in the next plan, so a step's plan
carries one fork per beam instead of token lists. Writing the new token into a partly filled
block that several beams now share copies it first (copy-on-write, `reserve_slots`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Literal

import numpy as np

from control_plane.request import Request, RequestStatus
from pagedserve.plan import BeamFork, SampledToken
from pagedserve.sampling_params import beam_candidates

# transformers' stand-in for "impossible": added to scores that must not be chosen.
_NEG = np.float32(-1.0e9)


def beam_request_id(client_id: str, slot: int) -> str:
    return f"{client_id}#b{slot}"


@dataclass
class Hypothesis:
    """A finished sequence: its generated tokens (the last one EOS, or the max_new_tokens-th),
    and its score: float32 sum of logprobs / len ** length_penalty."""

    token_ids: list[int]
    score: float
    ended_by_eos: bool = False

    @property
    def finish_reason(self) -> Literal["stop", "length"]:
        return "stop" if self.ended_by_eos else "length"


@dataclass
class BeamStep:
    """What a selection decided: the next beam of each slot, as (source slot, token, score),
    or done (with the hypotheses to return, best first)."""

    forks: list[tuple[int, int, np.float32]] = field(default_factory=list)
    done: bool = False


@dataclass(eq=False)
class BeamGroup:
    """The search state of one beam-search request (see the module docstring)."""

    client_id: str
    width: int
    num_return: int
    length_penalty: float
    early_stopping: bool | str
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    beams: list[Request] = field(default_factory=list)  # by slot
    scores: list[np.float32] = field(default_factory=list)  # running score by slot
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    # Forks the worker has not been told yet (the group was selected, not scheduled since).
    pending_forks: list[BeamFork] = field(default_factory=list)
    # Beams recomputed after a preemption wait, holding no blocks, until the first beam has
    # computed the prefix they share with it; they then fork its blocks (`shared_prefix`).
    unforked: set[str] = field(default_factory=set)

    @classmethod
    def start(cls, req: Request, eos_token_ids: tuple[int, ...], max_model_len: int) -> BeamGroup:
        """The group of a client request asking for beam search, with its first beam (the
        prompt alone), a child of the client's id."""
        sp = req.sampling
        group = cls(
            client_id=req.req_id,
            width=sp.beam_width,
            num_return=sp.n,
            length_penalty=sp.length_penalty,
            early_stopping=sp.early_stopping,
            max_new_tokens=min(sp.max_tokens, max_model_len - req.num_prompt_tokens),
            eos_token_ids=() if sp.ignore_eos else eos_token_ids,
        )
        first = Request(
            req_id=beam_request_id(req.req_id, 0),
            prompt_token_ids=list(req.prompt_token_ids),
            sampling=replace(sp, n=1),
            arrival_time=req.arrival_time,
            cache_salt=req.cache_salt,
            parent_id=req.req_id,
            index=0,
            block_hashes=list(req.block_hashes),
            beam=group,
        )
        group.beams = [first]
        group.scores = [np.float32(0.0)]
        return group

    @property
    def num_candidates(self) -> int:
        return beam_candidates(self.width, len(self.eos_token_ids))

    @property
    def num_generated(self) -> int:
        """Tokens each live beam has generated (all the same length)."""
        return self.beams[0].num_output_tokens

    @property
    def ids(self) -> list[str]:
        return [b.req_id for b in self.beams]

    def shared_prefix(self, beam: Request, block_size: int) -> int:
        """Tokens of `beam` whose KV it can take from the first beam: the full blocks of their
        common prefix, short of its last token."""
        first = self.beams[0].all_token_ids
        tokens = beam.all_token_ids
        n = 0
        limit = min(len(first), len(tokens) - 1)
        while n < limit and first[n] == tokens[n]:
            n += 1
        return n // block_size * block_size

    def recompute(self) -> None:
        """The beams lost their KV: all but the first will fork what they share with it."""
        self.pending_forks = []
        self.unforked = {b.req_id for b in self.beams[1:]}

    def worst_case_blocks(self, block_size: int) -> int:
        """KV blocks the group can hold at once: the prompt's full blocks shared, and per beam
        the rest of its longest sequence (the last sampled token needs no slot)."""
        prompt = self.beams[0].num_prompt_tokens
        shared = prompt // block_size
        final = prompt + self.max_new_tokens - 1
        return shared + self.width * (-(-final // block_size) - shared)

    def select(self, candidates: list[SampledToken]) -> BeamStep:
        """One selection step from each live beam's candidates (slot order); updates scores
        and finished hypotheses. See the module docstring."""
        assert len(candidates) == len(self.beams), "a candidate list per live beam"
        k, w = self.num_candidates, self.width
        step = self.num_generated + 1  # generated length of this step's sequences
        sizes = [len(c.top_token_ids) for c in candidates]
        total = sum(sizes)
        slots = np.repeat(np.arange(len(candidates)), sizes)
        ids = np.fromiter(chain.from_iterable(c.top_token_ids for c in candidates), np.int64, total)
        logprobs = np.fromiter(
            chain.from_iterable(c.top_logprobs for c in candidates), np.float32, total
        )
        scores = np.asarray(self.scores, dtype=np.float32)[slots] + logprobs  # float32 sums
        # Best first; among equal scores the lower (slot, token), as a flat top-k would order.
        best = np.lexsort((ids, slots, -scores))[:k]
        top = [(scores[i], int(slots[i]), int(ids[i])) for i in best]
        at_limit = step >= self.max_new_tokens
        hits = [at_limit or tok in self.eos_token_ids for _, _, tok in top]

        running = sorted(
            (
                (score + _NEG if hit else score, i)
                for i, ((score, _, _), hit) in enumerate(zip(top, hits, strict=True))
            ),
            key=lambda c: (-c[0], c[1]),
        )[:w]
        denominator = np.float32(step**self.length_penalty)
        for i in range(min(w, len(top))):
            if hits[i]:
                score, slot, tok = top[i]
                tokens = [*self.beams[slot].output_token_ids, tok]
                self._add_finished(
                    Hypothesis(tokens, float(score / denominator), tok in self.eos_token_ids)
                )
        if all(hits) or self._search_over(running[0][0], step):
            return BeamStep(done=True)
        return BeamStep(forks=[(top[i][1], top[i][2], score) for score, i in running])

    def _add_finished(self, hyp: Hypothesis) -> None:
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: -h.score)  # stable: earlier ones win ties
        del self.finished[self.width :]

    def _search_over(self, best_running: np.float32, step: int) -> bool:
        """transformers' stopping rule after a step (`_check_early_stop_heuristic` and
        `_beam_search_has_unfinished_sequences`), for one sequence."""
        if len(self.finished) < self.width:
            return False
        if self.early_stopping is True:
            return True
        lp = self.length_penalty
        if self.early_stopping == "never" and lp > 0.0:
            length = self.max_new_tokens
        else:
            length = step
        best_possible = best_running / np.float32(length**lp)
        worst = min(h.score for h in self.finished)
        return not bool(best_possible > np.float32(worst))

    def apply(self, step: BeamStep, known_to_worker: bool) -> list[Request]:
        """Makes the slots the selected beams; returns the requests of slots that did not
        exist before (the first step widens one beam to W). Each slot's request takes its
        source's tokens and computed count plus the token; the caller moves the block tables
        (`BlockManager.reassign`) and, when the worker holds the beams, the forks go into the
        next plan."""
        # Every slot reads its source as it was before any slot changed.
        sources = [
            (
                self.beams[src].req_id,
                self.beams[src].output_token_ids,
                self.beams[src].block_hashes,
                self.beams[src].num_computed_tokens,
            )
            for src, _, _ in step.forks
        ]
        added: list[Request] = []
        first = self.beams[0]
        for slot, ((_, tok, score), (src_id, outputs, hashes, computed)) in enumerate(
            zip(step.forks, sources, strict=True)
        ):
            if slot == len(self.beams):
                beam = Request(
                    req_id=beam_request_id(self.client_id, slot),
                    prompt_token_ids=first.prompt_token_ids,
                    sampling=first.sampling,
                    arrival_time=first.arrival_time,
                    status=first.status,
                    cache_salt=first.cache_salt,
                    parent_id=self.client_id,
                    index=slot,
                    beam=self,
                )
                self.beams.append(beam)
                self.scores.append(score)
                added.append(beam)
            beam = self.beams[slot]
            beam.output_token_ids = [*outputs, tok]
            beam.block_hashes = list(hashes)
            beam.num_computed_tokens = computed
            self.scores[slot] = score
            if known_to_worker:
                self.pending_forks.append(BeamFork(beam.req_id, src_id, tok))
        return added

    def results(self) -> list[Hypothesis]:
        """The sequences to return, best first."""
        return self.finished[: self.num_return]

    def copy_waiting(self) -> list[Request]:
        """Fresh WAITING copies of the live beams in a copy of this group (to requeue them,
        after a worker loss, where nothing is computed)."""
        group = replace(
            self,
            beams=[],
            scores=list(self.scores),
            finished=list(self.finished),
            pending_forks=[],
        )
        group.beams = [
            Request(
                b.req_id,
                list(b.prompt_token_ids),
                b.sampling,
                b.arrival_time,
                output_token_ids=list(b.output_token_ids),
                cache_salt=b.cache_salt,
                parent_id=b.parent_id,
                index=b.index,
                status=RequestStatus.WAITING,
                beam=group,
            )
            for b in self.beams
        ]
        group.recompute()
        return group.beams
