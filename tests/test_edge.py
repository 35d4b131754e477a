"""The edge: each kind of poison is refused with a reason, valid records pass unchanged."""

from __future__ import annotations

import json

import msgspec
import pytest

from gpusteward import topics
from gpusteward.edge import (
    DEADLETTER_MAX_BYTES,
    Edge,
    Limits,
    Rejected,
    dead_letter,
    nesting_depth_exceeds,
)
from gpusteward.schema import (
    AllocationEvent,
    DeadLetter,
    DeviceSample,
    NodeSample,
    PodAllocation,
    PodRef,
)
from gpusteward.settings import Settings

NOW = 1_763_683_200.0
SAMPLE = NodeSample(ts=NOW, node="n1", source="test", devices=[
    DeviceSample(uuid="GPU-0", index=0, model="H100", util_pct=50.0, ecc_sbe_volatile=3,
                 pod=PodRef(namespace="ns", name="p"))])
edge = Edge[NodeSample](NodeSample, key_of=lambda s: s.node, clock=lambda: NOW)


def _wire(**changes: object) -> bytes:
    doc = json.loads(msgspec.json.encode(SAMPLE))
    doc.update(changes)
    return json.dumps(doc).encode()


def test_a_valid_record_passes() -> None:
    assert edge(msgspec.json.encode(SAMPLE), b"n1") == SAMPLE


@pytest.mark.parametrize(("value", "key", "reason"), [
    (b"", b"n1", "empty value"),
    (b'{"ts": 1', b"n1", "malformed"),
    (_wire(ts="soon"), b"n1", "invalid: Expected `float`"),
    (_wire(devices=[{"uuid": "GPU-0", "index": 0, "model": "H100", "ecc_sbe_volatile": 2**70}]),
     b"n1", "`$.devices[0].ecc_sbe_volatile`"),
    (msgspec.json.encode(SAMPLE).replace(b'"util_pct":50.0', b'"util_pct":1e400'), b"n1",
     "out of range"),
    (_wire(ts=float("nan")), b"n1", "malformed"),
    (_wire(ts=1e308), b"n1", "`$.ts`"),
    (_wire(ts=NOW + 2 * 366 * 86400), b"n1", "ahead of the clock"),
    (_wire(schema=99), b"n1", "unknown schema version"),
    (_wire(node="x" * 300), b"x" * 300, "`$.node`"),
    (b'{"ts": 1, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", b"n1", "nests deeper"),
    (b'{"ts": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"n1", "nests deeper"),
    (_wire(devices=[[[[[[[[]]]]]]]] * 20).replace(b"[]", b"[" * 70 + b"]" * 70), b"n1",
     "nests deeper"),
    (msgspec.json.encode(SAMPLE), b"junk-\xff\xfe", "key is not UTF-8"),
    (msgspec.json.encode(SAMPLE), b"n2", "is not the payload's"),
    (b"\x00" * (1 << 20), b"n1", "exceeds"),
    (json.dumps({"kind": "xid", "ts": NOW, "node": "n1"}).encode(), b"n1", "invalid"),
])
def test_poison_is_refused_with_its_reason(value: bytes, key: bytes, reason: str) -> None:
    with pytest.raises(Rejected, match=reason.replace("[", r"\[").replace("$", r"\$")):
        edge(value, key)


def test_depth_in_a_field_the_schema_does_not_have_is_skipped() -> None:
    """Depth is measured only on a record the decoder refuses (counting brackets on every
    sample cost 1-2 % of the worker): one that decodes, its unknown field skipped, passes."""
    deep = _wire(extra=[]).replace(b'"extra": []', b'"extra": ' + b"[" * 200 + b"]" * 200)
    assert nesting_depth_exceeds(deep, edge.limits.max_depth)
    assert edge(deep, b"n1") == SAMPLE


def test_allocations_are_keyed_as_the_publisher_keys_them() -> None:
    alloc = Edge[AllocationEvent](AllocationEvent, key_of=topics.allocation_key, clock=lambda: NOW)
    pod = PodAllocation(ts=NOW, node="n1", pod=PodRef(namespace="ns", name="p", uid="u"),
                        phase="running")
    assert alloc(msgspec.json.encode(pod), b"n1/pod/u") == pod
    with pytest.raises(Rejected):
        alloc(msgspec.json.encode(pod), b"n1")


def test_depth_is_measured_without_being_fooled_by_strings() -> None:
    assert not nesting_depth_exceeds(b'{"a": "' + b"[" * 100 + b'\\"", "b": [[1]]}', 4)
    assert nesting_depth_exceeds(b'{"a": "\\\\", "b": [[[[[1]]]]]}', 4)
    assert not nesting_depth_exceeds(b'{"a": "\\\\", "b": [[[[1]]]]}', 5)
    assert not nesting_depth_exceeds(b"[" * 100, 4)  # unbalanced: the decoder's to refuse


def test_a_dead_letter_too_large_for_the_broker_is_cut_and_says_so() -> None:
    value = b"\xab" * (1 << 20)
    letter = dead_letter("t", 0, 7, b"k", value, "malformed")
    assert letter.truncated and letter.value_bytes == 1 << 20
    assert letter.value is not None and len(letter.value) + 1 <= DEADLETTER_MAX_BYTES
    assert "cut" in letter.error
    assert len(msgspec.json.encode(letter)) < 1_000_000
    small = dead_letter("t", 0, 7, b"k", b"v", "malformed")
    assert not small.truncated and small.value == b"v"
    assert msgspec.json.decode(msgspec.json.encode(small), type=DeadLetter) == small


def test_the_worker_refuses_a_record_from_a_clock_far_ahead_naming_the_skew() -> None:
    """A collector whose clock jumped a day ahead (or was set to 2030): the worker's edge
    refuses the record with the skew, instead of letting it move its node's event time a
    day on and make the node's correct samples late for that day. Minutes of skew pass."""
    worker = Edge[NodeSample](NodeSample, key_of=lambda s: s.node, clock=lambda: NOW,
                              limits=Limits(max_future_s=Settings().max_event_ahead_s))
    with pytest.raises(Rejected, match=r"is 86400 s ahead of the clock \(more than 900 s\)"):
        worker(_wire(ts=NOW + 86400), b"n1")
    assert worker(_wire(ts=NOW + 600), b"n1").ts == NOW + 600
