"""Property tests of the ring's slot state machine: the pure model, then the real ring."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvwire.shm import MessageQueue
from kvwire.shm.ring import RingModel, blocking_readers, can_write, min_live_rseq, slot_of

pytestmark = pytest.mark.timeout(180)  # fail fast instead of the global 300 s

class ModelMachine(RuleBasedStateMachine):
    """Random interleavings of write / read / drop against the spec's invariants."""

    @initialize(n_reader=st.integers(1, 4), n_chunks=st.integers(1, 6))
    def setup(self, n_reader: int, n_chunks: int) -> None:
        self.m = RingModel(n_reader, n_chunks)
        self.expect = [0] * n_reader  # next message each reader must see

    @rule()
    def write(self) -> None:
        before = self.m.can_write()
        assert self.m.write(self.m.wseq) == before

    @rule(r=st.integers(0, 3))
    def read(self, r: int) -> None:
        if r >= self.m.n_reader:
            return
        ok, payload = self.m.read(r)
        if ok:
            assert payload == self.expect[r]  # in order, nothing skipped, nothing torn
            self.expect[r] += 1

    @rule(r=st.integers(0, 3))
    def drop(self, r: int) -> None:
        if r < self.m.n_reader and sum(self.m.live) > 1:
            self.m.drop(r)

    @invariant()
    def never_overwrites_unread(self) -> None:
        m = self.m
        for r in range(m.n_reader):
            if m.live[r]:
                assert 0 <= m.wseq - m.rseqs[r] <= m.n_chunks

    @invariant()
    def progress(self) -> None:
        """Someone can always move: the writer, or a live reader with data."""
        m = self.m
        assert m.can_write() or any(m.live[r] and m.can_read(r) for r in range(m.n_reader))

    @invariant()
    def blocked_iff_someone_blocks(self) -> None:
        m = self.m
        assert m.can_write() == (not blocking_readers(m.rseqs, m.live, m.wseq, m.n_chunks))


TestModel = ModelMachine.TestCase
TestModel.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


class RealRingMachine(RuleBasedStateMachine):  # every payload fits one 256-byte chunk
    """The shared-memory queue (writer and readers in one process, non-blocking calls)
    must agree with the model at every step, including chunk-crossing sizes."""

    @initialize(n_reader=st.integers(1, 3), n_chunks=st.integers(1, 4))
    def setup(self, n_reader: int, n_chunks: int) -> None:
        self.m = RingModel(n_reader, n_chunks)
        self.w = MessageQueue(n_reader, n_reader, max_chunk_bytes=256, max_chunks=n_chunks,
                              spin_s=0.0)
        self.rs = [MessageQueue.create_from_handle(self.w.export_handle(), r, spin_s=0.0)
                   for r in range(n_reader)]
        self.w.wait_until_ready(timeout=5)
        for r in self.rs:
            r.wait_until_ready(timeout=5)

    @rule(size=st.sampled_from([0, 1, 100, 200, 230]))
    def write(self, size: int) -> None:
        payload = bytes([self.m.wseq % 256]) * size
        if self.m.write(payload):
            self.w.enqueue(payload, timeout=0)
        else:
            try:
                self.w.enqueue(payload, timeout=0)
            except TimeoutError:
                return
            raise AssertionError("real ring accepted a write the model refuses")

    @rule(r=st.integers(0, 2))
    def read(self, r: int) -> None:
        if r >= len(self.rs):
            return
        ok, payload = self.m.read(r)
        if ok:
            assert self.rs[r].dequeue(timeout=0) == payload
        else:
            try:
                got = self.rs[r].dequeue(timeout=0)
            except TimeoutError:
                return
            raise AssertionError(f"real ring delivered {got!r} the model does not have")

    def teardown(self) -> None:
        if not hasattr(self, "w"):
            return
        self.w.close()
        for r in self.rs:
            r.close()


TestRealRing = RealRingMachine.TestCase
TestRealRing.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                 suppress_health_check=[HealthCheck.too_slow])


def test_pure_helpers() -> None:
    assert slot_of(7, 4) == 3
    assert can_write(4, 0, 4) is False and can_write(4, 1, 4) is True
    assert min_live_rseq([3, 1, 5], [True, False, True], 9) == 3
    assert min_live_rseq([], [], 9) == 9


def test_a_dropped_reader_stops_blocking_the_writer_and_reads_nothing() -> None:
    """The model's drop (a reader declared dead): the writer, held by that reader's lag,
    may write again, and the dropped reader gets nothing even from a readable slot."""
    m = RingModel(n_reader=2, n_chunks=2)
    assert m.write("a") and m.write("b") and not m.write("c")  # reader 1 never reads
    assert m.read(0) == (True, "a") and m.read(0) == (True, "b")
    assert not m.can_write() and m.can_read(1)  # reader 1 still holds both slots
    m.drop(1)
    assert m.can_write() and m.write("c")
    assert m.read(1) == (False, None) and m.read(0) == (True, "c")
