"""The launcher's address book, stepped by hand: first round, re-registration, resolution, versions."""

from __future__ import annotations

import pytest

from psflow.errors import ClusterError, ConfigError
from psflow.launch.addressbook import REGISTERED, REREGISTERED, AddressBook, Entry

TASKS = ["chief:0", "ps:0", "ps:1", "worker:0"]


def full_book() -> AddressBook:
    book = AddressBook(TASKS)
    for i, t in enumerate(TASKS):
        book.register(t, f"127.0.0.1:{5000 + i}", pid=100 + i)
    return book


def test_the_first_round_is_complete_once_every_expected_task_registered_in_any_order() -> None:
    book = AddressBook(TASKS)
    assert book.missing() == TASKS and not book.is_complete
    steps = []
    for t in ["worker:0", "ps:1", "chief:0", "ps:0"]:
        reg = book.register(t, f"h:{len(steps)}")
        steps.append((reg.kind, reg.complete, book.missing()))
    assert steps == [
        (REGISTERED, False, ["chief:0", "ps:0", "ps:1"]),
        (REGISTERED, False, ["chief:0", "ps:0"]),
        (REGISTERED, False, ["ps:0"]),
        (REGISTERED, True, []),
    ]
    assert book.version == 4
    assert book.cluster_dict() == {"worker": ["h:0"], "ps": ["h:3", "h:1"], "chief": ["h:2"]}


def test_a_task_that_registers_again_replaces_its_entry_and_raises_the_version() -> None:
    book = full_book()
    before = book.resolve("ps:1")
    reg = book.register("ps:1", "127.0.0.1:6001", pid=999)
    assert reg.kind == REREGISTERED
    assert reg.previous == before
    assert reg.complete
    assert book.version == 5
    entry = book.resolve("ps:1")
    assert (entry.address, entry.pid, entry.attempt, entry.version) == ("127.0.0.1:6001", 999, 1, 5)
    assert book.cluster_dict()["ps"] == ["127.0.0.1:5001", "127.0.0.1:6001"]
    assert book.resolve("ps:0") == Entry("127.0.0.1:5001", 101, 0, 2)  # the others are untouched


def test_attempts_count_registrations_unless_the_task_names_its_attempt() -> None:
    book = full_book()
    assert [book.register("worker:0", f"h:{n}").entry.attempt for n in range(3)] == [1, 2, 3]
    assert book.register("worker:0", "h:x", attempt=7).entry.attempt == 7
    assert book.register("worker:0", "h:y").entry.attempt == 8


def test_a_re_registration_before_the_round_is_complete_keeps_it_waiting_for_the_missing() -> None:
    book = AddressBook(["ps:0", "worker:0"])
    book.register("ps:0", "h:1")
    reg = book.register("ps:0", "h:2")
    assert (reg.kind, reg.complete, book.missing()) == (REREGISTERED, False, ["worker:0"])
    with pytest.raises(ClusterError, match="worker:0 never registered"):
        book.cluster_dict()
    book.register("worker:0", "h:3")
    assert book.cluster_dict() == {"ps": ["h:2"], "worker": ["h:3"]}


def test_resolving_an_unknown_or_unregistered_task_says_which_and_why() -> None:
    book = AddressBook(["ps:0", "worker:0"])
    book.register("ps:0", "h:1")
    with pytest.raises(ClusterError, match=r"worker:0 has not registered with the launcher yet \(book version 1\)"):
        book.resolve("worker:0")
    with pytest.raises(ConfigError, match=r"Task 'ps:7' is not part of this run; expected one of \['ps:0', 'worker:0'\]"):
        book.resolve("ps:7")
    with pytest.raises(ConfigError, match="not part of this run"):
        book.register("evaluator:0", "h:2")
    with pytest.raises(ConfigError, match="registered without an address"):
        book.register("worker:0", "")
    assert book.version == 1  # refused registrations change nothing


def test_the_snapshot_is_the_whole_book_with_its_version() -> None:
    book = AddressBook(["ps:0", "worker:0"])
    book.register("ps:0", "h:1", pid=7)
    book.register("ps:0", "h:2", pid=8, attempt=1)
    assert book.snapshot() == {"version": 2, "tasks": {"ps:0": {"address": "h:2", "pid": 8, "attempt": 1, "version": 2}},
                               "members": {"replicas": 1, "launch_replicas": 1, "version": 0}}
    assert book.addresses() == {"ps:0": "h:2"} and book.pids() == {"ps:0": 8}


def test_expected_tasks_must_be_distinct() -> None:
    with pytest.raises(ConfigError, match="must be distinct"):
        AddressBook(["ps:0", "ps:0"])


def test_a_scale_adds_awaited_tasks_removes_retired_ones_and_raises_the_members_version() -> None:
    book = AddressBook(["ps:0", "worker:0", "worker:1"])
    for i, t in enumerate(book.expected):
        book.register(t, f"h:{i + 1}")
    assert book.is_complete and book.members() == {"replicas": 2, "launch_replicas": 2, "version": 0}
    book.scale(["ps:0", "worker:0", "worker:1", "worker:2"])
    assert not book.is_complete and book.missing() == ["worker:2"]  # its registration is awaited like the first round's
    assert book.members() == {"replicas": 3, "launch_replicas": 2, "version": 1}
    book.register("worker:2", "h:9")
    assert book.cluster_dict()["worker"] == ["h:2", "h:3", "h:9"]
    assert book.scale(["ps:0", "worker:0"]) == ["worker:1", "worker:2"]
    assert book.is_complete and book.cluster_dict() == {"ps": ["h:1"], "worker": ["h:2"]}
    assert book.members() == {"replicas": 1, "launch_replicas": 2, "version": 2}
    with pytest.raises(ConfigError, match="not part of this run"):
        book.register("worker:2", "h:10")  # a retired task is no longer expected
