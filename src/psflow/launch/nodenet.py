"""Which of this host's addresses a scheduler's nodes reach the launcher at (the coordinator's bind address).

The launcher's coordinator listens where every task can connect to it. On one host that is loopback;
on a cluster (``--backend slurm`` from a login node) it is this host's address on the nodes' network.
:func:`coordinator_address` chooses it from the nodes' addresses (pure, given this host's interfaces
and a route lookup): all nodes on loopback -> ``127.0.0.1``; else the address of the interface whose
subnet holds every node (the nodes' own network, as an operator would pick it); else the one source
address the kernel routes to every node from; else it refuses, naming ``--coordinator-host``. Off
loopback the coordinator admits only connections that prove the job secret (``docs/security.md``).

Called by :meth:`psflow.launch.slurm.SlurmBackend.coordinator_host` once the allocation's nodes are known.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Callable, Sequence

from psflow.cluster import is_loopback_host
from psflow.errors import ConfigError

_SIOCGIFADDR, _SIOCGIFNETMASK = 0x8915, 0x891B  # Linux ioctls: an interface's IPv4 address and netmask


def coordinator_address(node_addresses: Sequence[str], interfaces: Sequence[ipaddress.IPv4Interface],
                        route: Callable[[str], str]) -> str:
    """The address the coordinator binds so that every node in ``node_addresses`` reaches it.

    Args:
        node_addresses: the nodes' IP addresses (Slurm's NodeAddr).
        interfaces: this host's IPv4 interfaces (address and prefix), as :func:`local_interfaces` lists them.
        route: this host's source address on its route to an address (:func:`route_source`).

    Returns:
        ``127.0.0.1`` when every node is on loopback; else the first interface, loopback aside,
        whose subnet holds every node; else the source address common to the routes to every node.

    Raises:
        ConfigError: no single address reaches every node (they lie on different networks).

    Example:
        >>> coordinator_address(["10.1.0.7", "10.1.0.9"], [ipaddress.IPv4Interface("10.1.0.2/24")], route=str)
        '10.1.0.2'
    """
    if not node_addresses or all(is_loopback_host(a) for a in node_addresses):
        return "127.0.0.1"
    ips = [ipaddress.ip_address(a) for a in node_addresses]
    for itf in interfaces:
        if not itf.ip.is_loopback and all(ip in itf.network for ip in ips):
            return str(itf.ip)
    sources = {a: route(a) for a in node_addresses}
    if len(set(sources.values())) == 1:
        return next(iter(sources.values()))
    seen = ", ".join(f"{a} via {s}" for a, s in sources.items())
    raise ConfigError(f"No one address of this host reaches every node of the allocation (routes: {seen}). "
                      "Give the address the nodes reach this host at: psflow run --coordinator-host ADDRESS.")


def route_source(address: str) -> str:
    """This host's source address on its route to ``address`` (a UDP connect sends nothing: it only
    picks the route).

    Raises:
        ConfigError: no route leads to ``address``.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))
            return str(s.getsockname()[0])
    except OSError as e:
        raise ConfigError(f"No route from this host to node address {address!r} ({e}). "
                          "Give the address the nodes reach this host at: psflow run --coordinator-host ADDRESS.") from e


def local_interfaces() -> list[ipaddress.IPv4Interface]:
    """This host's IPv4 interfaces that are configured (address and prefix), in the kernel's order.
    Linux only (ioctl); empty elsewhere, where :func:`coordinator_address` falls back on routes."""
    out: list[ipaddress.IPv4Interface] = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return out
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            req = struct.pack("256s", name.encode()[:15])
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK, req)[20:24])
            except OSError:  # no IPv4 address on it
                continue
            out.append(ipaddress.IPv4Interface(f"{addr}/{mask}"))
    return out


def resolve(host: str) -> str:
    """``host``'s IPv4 address (itself when it is one).

    Raises:
        ConfigError: it does not resolve.
    """
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ConfigError(f"Slurm node {host!r} does not resolve from this host ({e}). "
                          "Give the address the nodes reach this host at: psflow run --coordinator-host ADDRESS.") from e
