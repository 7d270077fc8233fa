"""Caller tickets: the authentication throttle's key for Unix-socket callers."""

from __future__ import annotations

from asteria_server.service.limits import CallerTickets, throttle_key


def test_a_ticket_names_its_process_until_it_expires() -> None:
    now = [100.0]
    tickets = CallerTickets(ttl_s=10.0, clock=lambda: now[0])
    a, b = tickets.issue(uid=1000, pid=42), tickets.issue(uid=1000, pid=43)
    assert a != b
    assert throttle_key("unix:", a, tickets) == "unix uid=1000 pid=42"
    assert throttle_key("unix:", b, tickets) == "unix uid=1000 pid=43"
    now[0] = 111.0
    assert throttle_key("unix:", a, tickets) == "unix (no ticket)"  # expired


def test_callers_without_a_valid_ticket_share_a_key_and_tcp_keys_by_host() -> None:
    tickets = CallerTickets(max_kept=1)
    first = tickets.issue(uid=1, pid=1)
    assert tickets.issue(uid=1, pid=1) == first  # one process asking again: the same ticket
    tickets.issue(uid=1, pid=2)  # only one kept: the first is forgotten
    assert throttle_key("unix:", first, tickets) == "unix (no ticket)"
    assert throttle_key("unix:", "forged", tickets) == "unix (no ticket)"
    assert throttle_key("unix:", "", None) == "unix (no ticket)"
    assert throttle_key("ipv4:10.0.0.7:51234", "anything", tickets) == "ipv4:10.0.0.7"
