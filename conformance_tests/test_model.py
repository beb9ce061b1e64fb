"""The ``protocol`` group's model check: random operation sequences against a plain ``dict``.

A Hypothesis :class:`~hypothesis.stateful.RuleBasedStateMachine` drives
create / put / compare-and-swap / compare-and-delete / delete / add / get / list
on one client (no TTLs) and checks every result, error and revision against a
model ``{key: (value, revision)}``. Revisions are checked relative to each
other only: each write must return a larger one than every earlier write.
"""

from __future__ import annotations

import uuid
from typing import Callable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from rdzv_core import CompareFailedError, Entry, KeyExistsError, KeyNotFoundError, KVBackend, KVError, escape_segment

pytestmark = pytest.mark.protocol

NAMES = ["a", "b", "c/d", "c/e", "c/d/f", "c-d", escape_segment(b"\x00/.."), escape_segment("")]
names = st.sampled_from(NAMES)
# Values are canonical decimals or start with "x": never in between (" 1", "1_0", "007"),
# where parsers of different servers disagree.
values = st.one_of(
    st.integers(-(2**40), 2**40).map(lambda i: str(i).encode()),
    st.binary(max_size=12).map(lambda b: b"x" + b),
    st.just(b""),
)


def _is_counter(value: bytes) -> bool:
    return value[:1] != b"x" and value != b""


def make_machine(kv: KVBackend, base: str) -> type[RuleBasedStateMachine]:
    """A state machine class bound to ``kv``; each run works below a fresh sub-prefix of ``base``."""

    class KVModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.prefix = f"{base}m{uuid.uuid4().hex[:10]}/"
            self.model: dict[str, tuple[bytes, int]] = {}
            self.last_revision = 0

        def key(self, name: str) -> str:
            return self.prefix + name

        def wrote(self, entry: Entry, key: str, value: bytes) -> None:
            assert (entry.key, entry.value) == (key, value)
            assert entry.revision > self.last_revision, "revisions must increase with every write"
            self.last_revision = entry.revision
            self.model[key] = (value, entry.revision)

        def wrong_revision(self, key: str) -> int:
            actual = self.model[key][1]
            return actual + 1 if actual == 1 else actual - 1

        @rule(name=names, value=values)
        def create(self, name: str, value: bytes) -> None:
            key = self.key(name)
            if key in self.model:
                try:
                    kv.create(key, value)
                except KeyExistsError:
                    return
                raise AssertionError(f"create({key!r}) succeeded on a present key")
            self.wrote(kv.create(key, value), key, value)

        @rule(name=names, value=values)
        def put(self, name: str, value: bytes) -> None:
            key = self.key(name)
            self.wrote(kv.put(key, value), key, value)

        @rule(name=names, value=values, correct=st.booleans())
        def compare_and_swap(self, name: str, value: bytes, correct: bool) -> None:
            key = self.key(name)
            if key not in self.model:
                try:
                    kv.compare_and_swap(key, value, max(self.last_revision, 1))
                except KeyNotFoundError:
                    return
                raise AssertionError(f"CAS on absent {key!r} did not raise KeyNotFoundError")
            if not correct:
                try:
                    kv.compare_and_swap(key, value, self.wrong_revision(key))
                except CompareFailedError:
                    return
                raise AssertionError(f"CAS on {key!r} with a wrong revision did not raise CompareFailedError")
            self.wrote(kv.compare_and_swap(key, value, self.model[key][1]), key, value)

        @rule(name=names, correct=st.booleans())
        def compare_and_delete(self, name: str, correct: bool) -> None:
            key = self.key(name)
            if key not in self.model:
                try:
                    kv.compare_and_delete(key, max(self.last_revision, 1))
                except KeyNotFoundError:
                    return
                raise AssertionError(f"compare_and_delete on absent {key!r} did not raise KeyNotFoundError")
            if not correct:
                try:
                    kv.compare_and_delete(key, self.wrong_revision(key))
                except CompareFailedError:
                    return
                raise AssertionError(f"compare_and_delete on {key!r} with a wrong revision did not fail")
            kv.compare_and_delete(key, self.model.pop(key)[1])

        @rule(name=names)
        def delete(self, name: str) -> None:
            key = self.key(name)
            assert kv.delete(key) is (key in self.model)
            self.model.pop(key, None)

        @rule(name=names, delta=st.integers(-1000, 1000))
        def add(self, name: str, delta: int) -> None:
            key = self.key(name)
            old = self.model.get(key)
            if old is not None and not _is_counter(old[0]):
                try:
                    kv.add(key, delta)
                except KVError:
                    return
                raise AssertionError(f"add on non-integer {old[0]!r} succeeded")
            total = (0 if old is None else int(old[0])) + delta
            assert kv.add(key, delta) == total
            entry = kv.get(key)  # add returns no revision: learn it
            assert entry is not None
            self.wrote(entry, key, str(total).encode())

        @rule(name=names)
        def get(self, name: str) -> None:
            key = self.key(name)
            entry = kv.get(key)
            expected = self.model.get(key)
            assert (None if entry is None else (entry.value, entry.revision)) == expected

        @rule(sub=st.sampled_from(["", "c/", "c/d/"]))
        def list(self, sub: str) -> None:
            entries, revision = kv.list(self.prefix + sub)
            want = sorted((k, v, r) for k, (v, r) in self.model.items() if k.startswith(self.prefix + sub))
            assert [(e.key, e.value, e.revision) for e in entries] == want
            assert revision >= self.last_revision

        @precondition(lambda self: bool(self.model))
        @invariant()
        def revisions_below_head(self) -> None:
            assert max(r for _, r in self.model.values()) <= self.last_revision

    return KVModel


def test_kv_matches_dict_model(kv_factory: Callable[[], KVBackend], key_prefix: str) -> None:
    machine = make_machine(kv_factory(), key_prefix)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=30,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
