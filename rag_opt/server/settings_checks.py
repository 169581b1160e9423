"""The checks of ``rag-opt serve``'s settings values (:class:`rag_opt.server.settings.ProxySettings` runs them as
its field validators): URLs, networks, keys, host names, tokenizer lists, the document tag, threads and the
encoding cache's folder, store URL, format and namespaces. Each returns the value as the settings keep it or
raises :class:`~rag_opt.errors.ConfigurationError` with the problem in one line (the setting is named by the
caller). :func:`redact_url` writes an upstream URL for a message or a log line.
"""

from __future__ import annotations

import ipaddress
import os
import re

from pydantic import SecretStr

from rag_opt.errors import ConfigurationError
from rag_opt.models.kv_codec import FORMATS

__all__ = [
    "MIN_PROXY_KEY_CHARS",
    "check_cache_dir",
    "check_cache_format",
    "check_cache_namespace",
    "check_cache_url",
    "check_gemini_root",
    "check_hosts",
    "check_key",
    "check_networks",
    "check_proxy_key",
    "check_tag",
    "check_targets",
    "check_threads",
    "check_url",
    "redact_url",
]

MIN_PROXY_KEY_CHARS = 16  # a proxy key is removed wherever it appears in a header: shorter ones match by chance


def redact_url(url: str) -> str:
    """``url`` without the user-info part (``http://user:secret@host`` -> ``http://***@host``), for logs."""
    return re.sub(r"^(https?://)[^/@\s]*@", r"\1***@", url)


def check_url(v: str) -> str:
    v = v.strip()
    if not re.match(r"^https?://[^/\s]+", v):
        raise ConfigurationError(f"must be an http(s) URL such as http://localhost:8080/v1, got {v!r}")
    if "?" in v or "#" in v:
        raise ConfigurationError(f"must be a base URL without a query string or fragment, got {redact_url(v)!r}")
    return v.rstrip("/")


def check_gemini_root(v: str) -> str:
    if re.search(r"/v1(beta)?$", v):  # the client's path (/v1beta/models/...) is appended to it whole
        raise ConfigurationError(
            f"must be the Gemini API's root URL, without its version, e.g. https://generativelanguage.googleapis.com,"
            f" got {redact_url(v)!r}"
        )
    return v


def check_networks(v: str | None) -> str | None:
    for part in (v or "").split(","):
        try:
            if part.strip():
                ipaddress.ip_network(part.strip(), strict=False)
        except ValueError:
            raise ConfigurationError(f"{part.strip()!r} is not an IP address or network (CIDR)") from None
    return v


def check_key(v: SecretStr | None) -> SecretStr | None:
    if v is not None and (not v.get_secret_value() or v.get_secret_value() != v.get_secret_value().strip()):
        raise ConfigurationError("must be a non-empty key without surrounding whitespace")
    if v is not None and not v.get_secret_value().isprintable():
        raise ConfigurationError("must be printable characters")
    return v


def check_proxy_key(v: SecretStr | None) -> SecretStr | None:
    # every header carrying the key is stripped before forwarding: a short key would match unrelated headers
    if v is not None and len(v.get_secret_value()) < MIN_PROXY_KEY_CHARS:
        raise ConfigurationError(
            f"must be at least {MIN_PROXY_KEY_CHARS} characters (e.g. python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))')"
        )
    return v


def check_hosts(v: str | None) -> str | None:
    for part in (v or "").split(","):
        name = part.strip()
        if name and name != "*" and not re.fullmatch(r"\.?[A-Za-z0-9_.:\[\]-]+", name):
            raise ConfigurationError(f"{name!r} is not a host name (a name, .example.com or *)")
    return v


def check_targets(v: str | None) -> str | None:
    if v is not None and not [p for p in v.split(",") if p.strip()]:
        raise ConfigurationError("must name at least one tokenizer, e.g. o200k_base,cl100k_base")
    return v


def check_tag(v: str) -> str:
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.:-]*", v):
        raise ConfigurationError(f"must be a tag name such as 'document', got {v!r}")
    return v


def check_threads(v: str) -> str:
    v = str(v).strip()
    if v not in ("auto", "adaptive") and not (v.isdigit() and int(v) >= 1):
        raise ConfigurationError(f"must be 'auto', 'adaptive' or a positive number of threads, got {v!r}")
    return v


def check_cache_dir(v: str | None) -> str | None:
    if v is None:
        return None
    v = v.strip()
    if not v:
        raise ConfigurationError("must be a folder, got an empty path")
    path = os.path.expanduser(v)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigurationError(f"{v!r} exists and is not a folder")
    return path


def check_cache_url(v: str | None) -> str | None:
    if v is None or not v.strip():
        return None
    from rag_opt.models.cache_redis import ACCEPTED_URLS, redacted_url

    v = v.strip()
    if v.split("://", 1)[0] not in ("redis", "rediss", "unix", "valkey", "valkeys") or "://" not in v:
        raise ConfigurationError(f"{redacted_url(v)!r} is not a store URL: use {', '.join(ACCEPTED_URLS)}")
    return v


def check_cache_format(v: str) -> str:
    v = str(v).strip()
    if v not in FORMATS:
        raise ConfigurationError(f"must be one of {', '.join(FORMATS)}, got {v!r}")
    return v


def check_cache_namespace(v: str) -> str:
    v = str(v).strip()
    if v in ("none", "api-key"):
        return v
    if v.startswith("header:") and re.fullmatch(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+", v[len("header:") :]):
        return "header:" + v[len("header:") :].lower()
    raise ConfigurationError(f"must be none, api-key or header:NAME (a header name), got {v!r}")
