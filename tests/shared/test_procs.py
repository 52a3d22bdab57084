"""Port picking: the services' ``free_port`` stays below the ephemeral range (where outgoing
connections could take a picked port before its child binds it), never returns a held port, and
the tests' own allocator gives each xdist worker ports no other picker hands out."""

from __future__ import annotations

import socket

from headrace.shared.procs import PICK_RANGE, free_port, port_free
from tests import procs


def test_free_port_picks_a_bindable_port_below_the_ephemeral_range() -> None:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(PICK_RANGE[0] <= p <= PICK_RANGE[1] < ephemeral_low for p in ports)
    assert all(port_free(p) for p in ports)


def test_free_port_skips_a_held_port_and_falls_back_to_the_os() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        assert not port_free(port)
        got = free_port(pick=(port, port))    # the only candidate is held: the OS picks
        assert got != port and port_free(got)


def test_the_test_allocator_hands_out_steps_of_its_worker_block() -> None:
    block = procs._worker_ports()
    got = [procs.free_port() for _ in range(5)]
    assert len(set(got)) == 5 and all(p in block for p in got)
    assert block[-1] + procs.PORT_STEP <= PICK_RANGE[0]      # disjoint from what services pick
    assert all(all(port_free(p + i) for i in range(procs.PORT_STEP)) for p in got)
