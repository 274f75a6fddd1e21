"""Which ``Host`` (and ``Origin``) a request may name: the defence against DNS rebinding.

A web page on ``rebind.attacker.example`` can make its name resolve to 127.0.0.1 and then talk to a rollout server
on this machine with the page's own name in ``Host``; the browser also sends an ``Origin``. The server answers only
requests whose ``Host`` is a name it is actually reached by: a loopback name or address, the address it is bound
to, the names given with ``--allowed_hosts``, and, when bound to every interface (0.0.0.0 or ::), any IP literal
and this machine's host name. The port in ``Host`` is not compared (port forwarding changes it). An ``Origin`` or
``Referer``, when present, must name an allowed host too (``null`` is refused) and the port the ``Host`` names:
a page served on another port of this machine is another origin (``same_port``). ``--allowed_hosts '*'`` turns
the check off.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from grpokit.errors import ConfigError

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")
WILDCARD_BINDS = ("0.0.0.0", "::", "")


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def host_name(header: str) -> str | None:
    """The host of a ``Host`` header value, lower-case, without port or trailing dot; None if malformed."""
    value = header.strip().lower()
    if value.startswith("["):  # [v6] or [v6]:port
        end = value.find("]")
        if end < 0 or (value[end + 1 :] and not (value[end + 1] == ":" and value[end + 2 :].isdigit())):
            return None
        name = value[1:end]
        return name if _ip(name) is not None else None
    name, colon, port = value.rpartition(":")
    if not colon:
        name = value
    elif not port.isdigit() or ":" in name:
        return None
    name = name.rstrip(".")
    if not name or any(c in name for c in "/\\@?# \t"):
        return None
    return name


@dataclass(frozen=True)
class HostPolicy:
    names: frozenset[str]  # allowed names and IP literals (normalised)
    any_ip: bool = False  # bound to every interface: any IP literal
    any_host: bool = False  # --allowed_hosts '*'
    shown: tuple[str, ...] = field(default=())

    @classmethod
    def for_bind(cls, bind_host: str, extra: list[str] | tuple[str, ...] = ()) -> HostPolicy:
        names = set(LOOPBACK_NAMES) | {"127.0.0.1", "::1"}
        any_ip = bind_host in WILDCARD_BINDS
        if any_ip:
            names.add(socket.gethostname().lower())
        else:
            names.add(bind_host.strip("[]").lower())
        for value in extra:
            if value == "*":
                continue
            name = host_name(value)
            if name is None:
                raise ConfigError(f"--allowed_hosts {value!r}: give a host name or IP address (a port is ignored)")
            names.add(name)
        shown = tuple(sorted(names)) + (("any IP address",) if any_ip else ())
        return cls(frozenset(names), any_ip=any_ip, any_host="*" in extra, shown=shown)

    def allows_name(self, name: str | None) -> bool:
        if name is None:
            return False
        if self.any_host or name in self.names:
            return True
        ip = _ip(name)
        return ip is not None and (ip.is_loopback or self.any_ip)

    def allows_host(self, header: bytes | None) -> bool:
        if header is None:
            return self.any_host
        return self.allows_name(host_name(header.decode("latin-1")))

    def allows_origin(self, header: bytes) -> bool:
        value = header.decode("latin-1").strip()
        if self.any_host:
            return True
        try:
            parts = urlsplit(value)
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or not parts.netloc or "@" in parts.netloc:
            return False
        return self.allows_name(host_name(parts.netloc))

    def same_port(self, page: bytes, host: bytes | None) -> bool:
        """Whether the page ``page`` (an Origin or Referer URL) is on the port the ``host`` header names (a missing
        port is the page's scheme's default)."""
        if self.any_host:
            return True
        try:
            parts = urlsplit(page.decode("latin-1").strip())
            default = 443 if parts.scheme == "https" else 80
            page_port = parts.port or default
            host_port = urlsplit("//" + (host or b"").decode("latin-1").strip()).port or default
        except ValueError:
            return False
        return page_port == host_port

    def describe(self) -> str:
        return ", ".join(self.shown[:8]) + (" ..." if len(self.shown) > 8 else "")
