"""What the logs may hold: credentials redacted from ``--log-bodies``' headers and bodies and from httpx's request
log.

:func:`redact` blanks credentials in a text (the configured secrets, as they are or percent-encoded; JSON members
whose name looks like a credential, escaped inside a JSON string too, as an upstream echoing the request sends
them; credential query parameters such as ``key=``, ``api_key=`` and ``access_token=`` in any URL it holds;
``Bearer``/``Basic`` credentials; well-known key shapes in free text). :func:`redact_headers` writes headers for a
log with every header named like a credential (:data:`SENSITIVE_HEADERS`, and ``*key*`` — ``x-goog-api-key``
too —, ``*token*`` — ``x-headroom-proxy-token`` too —, ``*auth*``, ``*secret*``, ``*session*``...) replaced.
:func:`body_for_log` is a body as ``--log-bodies`` writes it to :data:`body_log`, redacted and cut at
:data:`LOG_BODY_LIMIT` characters; :func:`install_log_filters` keeps query strings and user-info out of httpx's
``HTTP Request: POST <url>`` lines. The proxy's front door (:mod:`rag_opt.server.security`) re-exports these names.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable

__all__ = [
    "LOG_BODY_LIMIT",
    "SENSITIVE_HEADERS",
    "body_for_log",
    "body_log",
    "install_log_filters",
    "redact",
    "redact_headers",
]

body_log = logging.getLogger("rag_opt.server.bodies")

SENSITIVE_HEADERS = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "api-key",
        "x-api-key",
        "x-ragopt-api-key",
        "x-headroom-proxy-token",
        "cookie",
        "set-cookie",
        "openai-organization",
        "openai-project",
    }
)
LOG_BODY_LIMIT = 64 * 1024  # characters of a body that --log-bodies writes
# header names that look like credentials (custom token headers: x-auth-token, x-goog-api-key, x-amz-security-token)
_SENSITIVE_NAME = re.compile(r"key|token|secret|passw|auth|credential|session|cookie|signature", re.IGNORECASE)

_JSON_SECRET = re.compile(  # (a member's name is short: bounded, so a long text is scanned in linear time)
    r'("(?:[^"\\]|\\.){0,40}?(?:api[_-]?key|apikey|authorization|password|passwd|secret|token|credential)'
    r'(?:[^"\\]|\\.){0,40}"\s*:\s*)"(?:[^"\\]|\\.)*"',
    re.IGNORECASE,
)
# the same inside a JSON string (an upstream echoing the request: "body": "{\"api_key\": \"...\"}")
_ESCAPED_JSON_SECRET = re.compile(  # (a member's name is short: bounded, so a long text is scanned in linear time)
    r'(\\"(?:[^"\\]|\\[^"]){0,40}?(?:api[_-]?key|apikey|authorization|password|passwd|secret|token|credential)'
    r'(?:[^"\\]|\\[^"]){0,40}\\"\s*:\s*)\\"(?:[^"\\]|\\[^"])*\\"',
    re.IGNORECASE,
)
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]+")
_KEY_LIKE = re.compile(r"\b(sk|pk|rk|sess)-[A-Za-z0-9_-]{8,}")
# well-known key shapes in free text (a key pasted into a message): Google API keys, GitHub tokens, Slack tokens,
# AWS access key ids, JSON Web Tokens
_KEY_SHAPES = re.compile(
    r"\bAIza[0-9A-Za-z_-]{30,}"
    r"|\bgh[pousr]_[A-Za-z0-9]{30,}"
    r"|\bgithub_pat_[A-Za-z0-9_]{30,}"
    r"|\bxox[abposr]-[A-Za-z0-9-]{10,}"
    r"|\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"
    r"|\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]+"
)
# "password=hunter2", "api_key: abc" in free text (not only in a URL's query string)
_TEXT_SECRET = re.compile(
    r"(?i)\b((?:password|passwd|pwd|passphrase|secret|client[_-]?secret|api[_-]?key|apikey|access[_-]?token"
    r"|auth[_-]?token|token)\s*[=:]\s*)(?![\s\"'\\]|\[redacted\])[^\s\"'\\&,;]+"
)
# a credential in a URL's query string (?key=..., &api_key=..., access_token=...)
_QUERY_SECRET = re.compile(
    r"([?&](?:key|api[_-]?key|apikey|access[_-]?token|token|auth|secret|password|signature|sig)=)[^&#\s\"'\\]+",
    re.IGNORECASE,
)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with credentials replaced by ``[redacted]``: the given secret values (as they are or
    percent-encoded, wholly or in part, any number of times over), JSON members whose name looks like a
    credential (``api_key``, ``authorization``, ``token``, ``password``, ``secret``...; also escaped inside a JSON
    string, as an upstream that echoes the request sends them), credential query parameters (``?key=...``,
    ``&access_token=...``), ``Bearer``/``Basic`` credentials, ``password=...``/``api_key: ...`` in free text, and
    well-known key shapes: ``sk-...``-style keys, Google API keys (``AIza...``), GitHub (``ghp_...``,
    ``github_pat_...``) and Slack (``xoxb-...``) tokens, AWS access key ids (``AKIA...``) and JSON Web Tokens."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "[redacted]")
            if "%" in text:
                text = _percent_encoded(secret).sub("[redacted]", text)
    text = _JSON_SECRET.sub(r'\1"[redacted]"', text)
    if '\\"' in text:
        text = _ESCAPED_JSON_SECRET.sub(r'\1\\"[redacted]\\"', text)
    text = _QUERY_SECRET.sub(r"\1[redacted]", text)
    text = _BEARER.sub(r"\1 [redacted]", text)
    text = _KEY_LIKE.sub(r"\1-[redacted]", text)
    text = _KEY_SHAPES.sub("[redacted]", text)
    return _TEXT_SECRET.sub(r"\1[redacted]", text)


@functools.lru_cache(maxsize=64)
def _percent_encoded(secret: str) -> re.Pattern[str]:
    """``secret`` with each of its bytes as it is or percent-encoded (``%4B``, ``%4b``, ``%254B``: encoded again)."""
    parts = []
    for ch in secret:
        encoded = "".join(rf"%(?:25)*[{b >> 4:X}{b >> 4:x}][{b & 15:X}{b & 15:x}]" for b in ch.encode("utf-8"))
        parts.append(f"(?:{re.escape(ch)}|{encoded})")
    return re.compile("".join(parts))


def redact_headers(headers: Iterable[tuple[bytes, bytes]], secrets: Iterable[str] = ()) -> str:
    """Headers as ``name: value`` lines for a log, credential headers replaced by ``[redacted]``."""
    secrets = tuple(secrets)
    lines = []
    for k, v in headers:
        name = k.decode("latin-1").lower()
        sensitive = name in SENSITIVE_HEADERS or _SENSITIVE_NAME.search(name) is not None
        value = "[redacted]" if sensitive else redact(v.decode("latin-1"), secrets)
        lines.append(f"{name}: {value}")
    return "; ".join(lines)


def body_for_log(body: bytes, secrets: Iterable[str] = ()) -> str:
    """A body for ``--log-bodies``: decoded, redacted and cut to :data:`LOG_BODY_LIMIT` characters."""
    text = body.decode("utf-8", errors="replace")
    cut = len(text) > LOG_BODY_LIMIT
    # redacted before the cut (a key across it is still recognised), with room for what redaction removes
    text = redact(text[: 2 * LOG_BODY_LIMIT], secrets)[:LOG_BODY_LIMIT]
    return json.dumps(text, ensure_ascii=False) + (f" ... ({len(body)} bytes in all)" if cut else "")


class _RedactURLs(logging.Filter):
    """On the ``httpx`` logger (its INFO line ``HTTP Request: POST <url> ...``): URLs without query strings or
    user-info, which may carry credentials."""

    _URL = re.compile(r"(https?://)(?:[^/@\s]*@)?([^?\s]*)\?\S*")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args and isinstance(record.args, tuple):
            record.args = tuple(
                self._URL.sub(r"\1\2?[redacted]", str(a)) if "://" in str(a) else a for a in record.args
            )
        return True


def install_log_filters() -> None:
    """Keep credentials in URLs out of httpx's request log (idempotent)."""
    httpx_logger = logging.getLogger("httpx")
    if not any(isinstance(f, _RedactURLs) for f in httpx_logger.filters):
        httpx_logger.addFilter(_RedactURLs())
