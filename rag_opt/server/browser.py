"""What a web page could make a browser send to the proxy: checks against DNS rebinding and cross-site requests.

Without a proxy key (the default on loopback), any page the operator visits could otherwise make the browser
send requests through the proxy — carrying the operator's ``--upstream-api-key`` — either cross-site (CSRF: a
``text/plain`` or form POST needs no CORS preflight) or, after DNS rebinding, as if same-origin. So:

- **Host** (DNS rebinding): the ``Host`` header's name must be one the proxy answers to
  (:class:`HostPolicy`): its listen address; with a loopback or wildcard listen address also ``localhost``,
  ``127.0.0.1`` and ``::1``; with a wildcard one (``0.0.0.0``, ``::``) also any IP address (an address cannot
  be rebound); and the names of ``--allowed-hosts`` (``name``, ``.example.com`` for it and its subdomains,
  ``*`` for any). The port is not compared. A request without ``Host`` (HTTP/1.0) is not a browser's.
- **Origin** (CSRF): a browser sends ``Origin`` with every cross-origin request that can change anything, and
  ``Sec-Fetch-Site`` with every request. A request whose ``Origin`` is not the proxy's own (scheme and the
  request's ``Host``), or is ``null``, and one marked ``Sec-Fetch-Site: cross-site`` or ``same-site`` without
  such an ``Origin``, is refused: the proxy serves programs, not web pages, and answers no CORS preflight.
- **Content type** (CSRF): the JSON routes (:data:`~rag_opt.server.paths.JSON_PATHS`) take
  ``application/json`` bodies only; another declared type (``text/plain``, a form) is a 415. A body without a
  ``Content-Type`` is read as JSON (a browser sending one cross-origin sends an ``Origin`` too).

Each check answers with the status, message and code of a refusal, or None; the probes (``/livez``...) are
not checked by the caller.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["LOOPBACK_NAMES", "HostPolicy", "Refusal", "check_browser", "check_content_type", "host_name"]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARD = frozenset({"0.0.0.0", "::", ""})
_JSON_TYPES = frozenset({"application/json"})

Refusal = tuple[int, str, str]
"""(status, message, error code) of a refused request."""


def host_name(value: str) -> str | None:
    """The host name of a ``Host`` header value (``name[:port]`` or ``[v6]:port``), lowercased, without a
    trailing dot; None when it is not one."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        rest = v[end + 1 :] if end > 0 else "?"
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return None
        return v[1:end]
    name, sep, port = v.rpartition(":")
    if not sep:
        name = v
    elif not port.isdigit() or ":" in name:
        return None
    name = name[:-1] if name.endswith(".") else name
    return name or None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class HostPolicy:
    """The host names the proxy answers to (see the module docstring)."""

    names: frozenset[str]
    suffixes: tuple[str, ...] = ()  # ".example.com": any subdomain (and example.com itself)
    any_ip: bool = False  # listening on every interface: any IP address literal
    any_host: bool = False  # "*" in --allowed-hosts

    @classmethod
    def build(cls, listen: str, allowed: str | None = None) -> HostPolicy:
        """The policy of a proxy listening on ``listen`` with ``--allowed-hosts`` ``allowed``."""
        host = listen.strip().lower().strip("[]")
        names = {host} if host not in _WILDCARD else set()
        if host in _WILDCARD or _is_loopback(host):
            names |= LOOPBACK_NAMES
        entries = [p.strip().lower() for p in (allowed or "").split(",") if p.strip()]
        suffixes = tuple(e for e in entries if e.startswith("."))
        names |= {e.strip("[]").rstrip(".") for e in entries if not e.startswith(".") and e != "*"}
        return cls(frozenset(names), suffixes, host in _WILDCARD, "*" in entries)

    def allows(self, name: str) -> bool:
        """Whether host name ``name`` (see :func:`host_name`) is one the proxy answers to."""
        if self.any_host or name in self.names:
            return True
        if any(name == s[1:] or name.endswith(s) for s in self.suffixes):
            return True
        return self.any_ip and _is_ip(name)


def _same_origin(origin: str, hosts: list[str]) -> bool:
    """Whether ``origin`` is the proxy's own: an http(s) origin whose host and port are the request's ``Host``."""
    try:
        parts = urlsplit(origin)
        _ = parts.port  # ValueError for a malformed port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query:
        return False
    default = ":80" if parts.scheme == "http" else ":443"
    netloc = parts.netloc.lower().removesuffix(default)
    return len(hosts) == 1 and netloc == hosts[0].strip().lower().removesuffix(default)


def check_browser(headers: Iterable[tuple[bytes, bytes]], policy: HostPolicy) -> Refusal | None:
    """Refuse a request whose ``Host`` the proxy does not answer to, or that a browser sent cross-origin."""
    hosts: list[str] = []
    origins: list[str] = []
    fetch_site: list[str] = []
    for k, v in headers:
        name = k.lower()
        if name == b"host":
            hosts.append(v.decode("latin-1"))
        elif name == b"origin":
            origins.append(v.decode("latin-1").strip())
        elif name == b"sec-fetch-site":
            fetch_site.append(v.decode("latin-1").strip().lower())
    for value in hosts:
        found = host_name(value)
        if found is None or not policy.allows(found):
            return (
                403,
                "the request's Host is not a name this proxy answers to (a DNS rebinding guard): use its listen "
                "address, or start it with --allowed-hosts",
                "host_not_allowed",
            )
    own = bool(origins) and all(_same_origin(o, hosts) for o in origins)
    if (origins and not own) or (not own and any(s in ("cross-site", "same-site") for s in fetch_site)):
        return (
            403,
            "cross-origin requests from web browsers are refused (a CSRF guard): call the proxy from a program, not "
            "from a web page",
            "cross_origin_request",
        )
    return None


def check_content_type(headers: Iterable[tuple[bytes, bytes]]) -> Refusal | None:
    """Refuse a body declared as anything but ``application/json`` (on the JSON routes)."""
    for k, v in headers:
        if k.lower() == b"content-type":
            media = v.decode("latin-1").split(";", 1)[0].strip().lower()
            if media not in _JSON_TYPES:
                return (
                    415,
                    "the request body must be JSON: send it with 'Content-Type: application/json'",
                    "unsupported_media_type",
                )
    return None
