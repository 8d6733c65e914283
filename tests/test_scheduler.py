"""The scheduler against simple invariants: FCFS, the budget, nothing lost, cancelled never run."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from florist.server.scheduler import CANCELLED, DONE, EXPIRED, Overloaded, Request, Scheduler


def test_importing_the_scheduler_does_not_import_torch():
    code = "import sys, florist.server.scheduler; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_fcfs_within_token_and_sequence_budgets():
    s = Scheduler(max_batch_tokens=10, max_batch_seqs=3, max_pending_tokens=1000)
    a, b = Request([4, 4, 4]), Request([1, 1, 1, 1])
    s.add(a)
    s.add(b)
    first = s.next_batch()
    assert [(r, i) for r, i in first.seqs] == [(a, 0), (a, 1)] and first.num_tokens == 8  # a third 4 would make 12
    second = s.next_batch()
    assert second.seqs == [(a, 2), (b, 0), (b, 1)]  # three sequences at most
    assert s.next_batch().seqs == [(b, 2), (b, 3)]
    assert s.next_batch() is None
    assert s.complete(first) == [] and s.complete(second) == [a]
    assert a.state == DONE and b.state != DONE


def test_a_sequence_longer_than_the_budget_runs_alone_and_is_not_overtaken():
    s = Scheduler(max_batch_tokens=8, max_batch_seqs=8, max_pending_tokens=1000)
    small, big, after = Request([2]), Request([50]), Request([1])
    for r in (small, big, after):
        s.add(r)
    assert s.next_batch().seqs == [(small, 0)]  # big does not fit behind small...
    assert s.next_batch().seqs == [(big, 0)]  # ...so it runs alone next, before `after`
    assert s.next_batch().seqs == [(after, 0)]


def test_pending_bound_refuses_with_a_message_and_frees_on_cancel():
    s = Scheduler(max_batch_tokens=8, max_batch_seqs=8, max_pending_tokens=10)
    a = Request([6])
    s.add(a)
    with pytest.raises(Overloaded, match="6 tokens are already queued, this request adds 5, the bound is 10"):
        s.add(Request([5]))
    s.cancel(a)
    assert a.state == CANCELLED and s.pending_tokens == 0 and s.pending_seqs == 0
    s.add(Request([5]))
    assert s.next_batch().num_tokens == 5


def test_expired_requests_are_dropped_before_they_run():
    now = [0.0]
    s = Scheduler(max_batch_tokens=100, max_batch_seqs=8, max_pending_tokens=1000, clock=lambda: now[0])
    late, fine = Request([3, 3], deadline=1.0), Request([2], deadline=5.0)
    s.add(late)
    s.add(fine)
    now[0] = 2.0
    assert s.next_batch().seqs == [(fine, 0)]
    assert s.take_expired() == [late] and late.state == EXPIRED
    assert s.pending_tokens == 0 and s.take_expired() == []


def test_results_of_a_cancelled_request_already_running_are_ignored():
    s = Scheduler(max_batch_tokens=4, max_batch_seqs=8, max_pending_tokens=1000)
    r = Request([3, 3])
    s.add(r)
    running = s.next_batch()
    s.cancel(r)
    assert s.next_batch() is None  # its second sequence never runs
    assert s.complete(running) == [] and r.state == CANCELLED


def test_many_cancellations_compact_the_queue():
    s = Scheduler(max_batch_tokens=4, max_batch_seqs=8, max_pending_tokens=10**6)
    reqs = [Request([1]) for _ in range(1000)]
    for r in reqs:
        s.add(r)
    for r in reqs[:-1]:
        s.cancel(r)
    assert len(s._queue) < 200
    assert s.next_batch().seqs == [(reqs[-1], 0)]


class SchedulerMachine(RuleBasedStateMachine):
    """Random interleavings of add / next_batch / complete / cancel / time passing, checked
    against a model: the arrival order of every admitted sequence."""

    @initialize(tokens=st.integers(1, 64), seqs=st.integers(1, 6), pending=st.integers(1, 400))
    def setup(self, tokens, seqs, pending):
        self.now = 0.0
        self.s = Scheduler(tokens, seqs, pending, clock=lambda: self.now)
        self.arrival: list[tuple[Request, int]] = []  # every admitted sequence, in arrival order
        self.head = 0  # arrival entries before this one were scheduled or skipped
        self.scheduled: set[tuple[int, int]] = set()
        self.in_flight = []
        self.requests: list[Request] = []
        self.finished: list[Request] = []

    @rule(lens=st.lists(st.integers(1, 90), min_size=1, max_size=6), ttl=st.none() | st.floats(0.5, 20))
    def add(self, lens, ttl):
        req = Request(lens, deadline=None if ttl is None else self.now + ttl)
        before = self.s.pending_tokens
        try:
            self.s.add(req)
        except Overloaded:
            assert before + sum(lens) > self.s.max_pending_tokens
            return
        assert before + sum(lens) <= self.s.max_pending_tokens
        self.requests.append(req)
        self.arrival.extend((req, i) for i in range(len(lens)))

    @rule()
    def next_batch(self):
        batch = self.s.next_batch()
        for req in self.s.take_expired():
            assert req.deadline is not None and req.deadline <= self.now and req.state == EXPIRED
        if batch is None:
            assert self.s.pending_seqs == 0
            assert all(not r.live for r, _ in self.arrival[self.head :])
            return
        assert batch.num_seqs <= self.s.max_batch_seqs
        assert batch.num_tokens <= self.s.max_batch_tokens or batch.num_seqs == 1, "budget exceeded"
        assert batch.num_tokens == sum(r.seq_lens[i] for r, i in batch.seqs)
        for req, i in batch.seqs:
            assert req.live, "a cancelled or expired request was scheduled"
            assert req.deadline is None or self.now < req.deadline
            # FCFS: everything skipped on the way belongs to a dropped request.
            while self.arrival[self.head] != (req, i):
                skipped, _ = self.arrival[self.head]
                assert not skipped.live, "a waiting sequence was overtaken"
                self.head += 1
            self.head += 1
            self.scheduled.add((id(req), i))
        # The batch stops only where the next waiting sequence would break the budget.
        rest = [(r, i) for r, i in self.arrival[self.head :] if r.live and (r.deadline is None or self.now < r.deadline)]
        if rest:
            r, i = rest[0]
            assert batch.num_tokens + r.seq_lens[i] > self.s.max_batch_tokens or batch.num_seqs == self.s.max_batch_seqs
        self.in_flight.append(batch)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def complete(self, data):
        batch = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        for req in self.s.complete(batch):
            assert req.state == DONE and req not in self.finished
            assert all((id(req), i) in self.scheduled for i in range(len(req.seq_lens)))
            self.finished.append(req)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def cancel(self, data):
        req = data.draw(st.sampled_from(self.requests))
        was_live, before = req.live, req.state
        self.s.cancel(req)
        assert req.state == (CANCELLED if was_live else before)

    @rule(dt=st.floats(0, 8))
    def tick(self, dt):
        self.now += dt

    @invariant()
    def accounting(self):
        if not hasattr(self, "s"):
            return
        waiting = [(r, i) for r, i in self.arrival[self.head :] if r.live]
        assert self.s.pending_seqs == len(waiting)
        assert self.s.pending_tokens == sum(r.seq_lens[i] for r, i in waiting)
        assert self.s.pending_tokens <= self.s.max_pending_tokens

    def teardown(self):
        if not hasattr(self, "s"):
            return
        # Every sequence is eventually scheduled, unless its request was dropped.
        while self.s.has_pending():
            self.next_batch()
        while self.in_flight:
            for req in self.s.complete(self.in_flight.pop()):
                self.finished.append(req)
        for req in self.requests:
            if req.state not in (CANCELLED, EXPIRED):
                assert req.state == DONE and req in self.finished
        assert len(self.finished) == len(set(map(id, self.finished)))


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
