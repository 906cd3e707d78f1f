# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""The lookup batcher the vLLM tier and the direct spec share (vLLM-free; both are also tested
end to end against a daemon in tests/vllm)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstored_client.vllm.lookups import LookupBatcher

NS = "ns"
A, B, C = b"a" * 36, b"b" * 36, b"c" * 36
NEVER = 3600.0


@dataclass(frozen=True)
class Req:
    req_id: str


class Sender:
    """Records what flush sends; `accept` says whether it can send now."""

    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.sent: list[tuple[str, list[bytes], Req | None]] = []

    def __call__(self, namespace_id: str, keys: list[bytes], request: Req | None) -> bool:
        if self.accept:
            self.sent.append((namespace_id, keys, request))
        return self.accept


def test_one_batch_per_namespace_and_a_hit_is_shared():
    batcher: LookupBatcher[bytes, Req] = LookupBatcher()
    r1, r2 = Req("r1"), Req("r2")
    assert batcher.ask(NS, A, r1) is None and batcher.ask(NS, B, r1) is None
    assert batcher.ask(NS, A, r2) is None  # already asked: joins, no second query
    assert batcher.ask("other", A, r2) is None
    send = Sender()
    batcher.flush(send, give_up=False, timeout_s=NEVER)
    assert sorted((ns, keys) for ns, keys, _ in send.sent) == [("ns", [A, B]), ("other", [A])]
    assert not batcher.queued
    batcher.resolve(NS, [A, B], [True, False])
    assert batcher.ask(NS, A, r2) is True
    assert batcher.ask(NS, A, Req("r3")) is True  # a hit is shared with a newcomer
    assert batcher.ask(NS, B, r1) is False
    assert batcher.ask(NS, B, Req("r3")) is None  # a miss is not: the chunk may be stored by now
    assert batcher.queued


def test_keys_of_finished_requests_are_not_asked_for():
    batcher: LookupBatcher[bytes, Req] = LookupBatcher()
    batcher.ask(NS, A, Req("gone"))
    batcher.ask(NS, B, Req("stays"))
    assert batcher.request_finished("gone") == {(NS, A)}
    send = Sender()
    batcher.flush(send, give_up=False, timeout_s=NEVER)
    assert [keys for _, keys, _ in send.sent] == [[B]]


def test_an_answer_in_flight_outlives_its_requests_until_it_arrives():
    batcher: LookupBatcher[bytes, Req] = LookupBatcher()
    batcher.ask(NS, A, Req("r1"))
    batcher.flush(Sender(), give_up=False, timeout_s=NEVER)
    batcher.request_finished("r1")
    assert batcher.probe((NS, A)) is not None  # in flight
    batcher.resolve(NS, [A], [True])
    assert batcher.probe((NS, A)) is None  # nobody waits for it


def test_unsent_keys_expire_one_by_one_or_all_when_giving_up():
    batcher: LookupBatcher[bytes, Req] = LookupBatcher()
    r = Req("r")
    batcher.ask(NS, A, r)
    batcher.flush(Sender(accept=False), give_up=False, timeout_s=NEVER)
    assert batcher.ask(NS, A, r) is None and batcher.queued  # still waiting
    batcher.flush(Sender(accept=False), give_up=False, timeout_s=0.0)
    assert batcher.ask(NS, A, r) is False and not batcher.queued
    batcher.ask(NS, B, r)
    batcher.flush(Sender(accept=False), give_up=True, timeout_s=NEVER)
    assert batcher.ask(NS, B, r) is False


def test_per_request_batches_go_whole_and_hits_are_asked_again():
    batcher: LookupBatcher[bytes, Req] = LookupBatcher(per_request=True, reask_hits=True)
    r1, r2 = Req("r1"), Req("r2")
    for key in (A, B):
        batcher.ask(NS, key, r1)
    batcher.ask(NS, C, r2)
    send = Sender()
    batcher.flush(send, give_up=False, timeout_s=NEVER)
    assert sorted((keys, req) for _, keys, req in send.sent) == [([A, B], r1), ([C], r2)]
    batcher.resolve(NS, [A, B], [True, False])
    assert batcher.ask(NS, A, r1) is None  # the owner holds hits (leases): a hit verdict is asked again
    batcher.request_finished("r1")
    batcher.flush(send := Sender(), give_up=False, timeout_s=NEVER)
    assert send.sent == []  # its request finished before the batch went out


def test_a_per_request_batch_expires_as_a_whole():
    """B waited past the deadline, C did not: a namespace batch gives up on B alone, a per-request
    batch (a prefix) on both."""
    for per_request, expected in ((False, (False, None)), (True, (False, False))):
        batcher: LookupBatcher[bytes, Req] = LookupBatcher(per_request=per_request)
        r = Req("r")
        batcher.ask(NS, B, r)
        batcher.ask(NS, C, r)
        probe = batcher.probe((NS, B))
        assert probe is not None
        probe.since -= 10.0  # asked 10 s ago
        batcher.flush(Sender(accept=False), give_up=False, timeout_s=5.0)
        assert (batcher.ask(NS, B, r), batcher.ask(NS, C, r)) == expected, per_request


def test_mark_miss_turns_answered_verdicts_into_misses():
    batcher: LookupBatcher[bytes, Req] = LookupBatcher()
    r = Req("r")
    batcher.ask(NS, A, r)
    batcher.ask(NS, B, r)
    batcher.flush(Sender(), give_up=False, timeout_s=NEVER)
    batcher.resolve(NS, [A], [True])
    batcher.mark_miss(NS, [A, B])
    assert batcher.ask(NS, A, r) is False
    unanswered = batcher.probe((NS, B))
    assert unanswered is not None and unanswered.result is None  # untouched
