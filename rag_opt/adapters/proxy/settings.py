"""Settings of the OpenAI-compatible proxy, from command-line arguments and ``RAG_OPT_*`` environment variables.

Precedence: command line > environment > defaults. Every field ``name`` has the environment variable
``RAG_OPT_<NAME>`` (e.g. ``RAG_OPT_UPSTREAM``, ``RAG_OPT_RATIO``, ``RAG_OPT_UPSTREAM_API_KEY``,
``RAG_OPT_PROXY_MODEL`` — the same variable the library reads for its default proxy model).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

ENV_PREFIX = "RAG_OPT_"
DEFAULT_RATIO = 0.5
_BUDGET_FIELDS = ("ratio", "target_tokens", "threshold")
_CLI_FLAGS = {"proxy_model": "--model"}  # where a command-line flag is not --<field-name>


def redact_url(url: str) -> str:
    """``url`` without the user-info part (``http://user:secret@host`` -> ``http://***@host``), for logs."""
    return re.sub(r"^(https?://)[^/@\s]*@", r"\1***@", url)


class ProxySettings(BaseModel):
    """Configuration of ``rag-opt serve``.

    The compression budget is one of ``ratio`` (default 0.5 when none is given), ``target_tokens`` or
    ``threshold``; a request may override it (``rag_opt`` field or ``x-ragopt-*`` headers).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    upstream: str = Field(description="the upstream's OpenAI base URL, e.g. https://api.openai.com/v1")
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    upstream_api_key: SecretStr | None = Field(
        default=None, description="when set, replaces the clients' Authorization header (never logged)"
    )
    # compression
    ratio: float | None = Field(default=None, gt=0, le=1)
    target_tokens: int | None = Field(default=None, ge=0)
    threshold: float | None = Field(default=None, ge=0, le=1)
    ordering: str = "input"
    target: str | None = Field(default=None, description="tokenizer of the upstream LLM (budgets are in its tokens)")
    proxy_model: str | None = Field(default=None, description="proxy model (None: the embedded default)")
    device: str | None = None
    dtype: str | None = None
    probe: str | None = "auto"
    # where context is found
    document_tag: str = Field(default="document", description="documents are <TAG ...>...</TAG> blocks")
    tool_messages: bool = Field(default=True, description="optimize large tool/function result messages")
    tool_min_chars: int = Field(default=2000, ge=1, description="a tool message is context from this many chars")
    # behaviour
    time_budget_ms: float = Field(default=10_000.0, gt=0, description="optimizer time budget; over it: fail open")
    max_concurrency: int = Field(default=1, ge=1, description="optimizations running at once (worker threads)")
    max_queue: int = Field(default=8, ge=0, description="optimizations waiting for a worker; beyond: overload")
    on_overload: Literal["fail-open", "reject"] = Field(
        default="fail-open", description="when the optimizer is overloaded: forward unoptimized, or answer 429"
    )
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1, description="larger request bodies get a 413")
    optimizer_nice: int = Field(
        default=10, ge=0, le=19, description="CPU priority of the optimizer threads below the event loop (Linux)"
    )
    connect_timeout: float = Field(default=10.0, gt=0, description="seconds to connect to the upstream")
    read_timeout: float = Field(default=600.0, gt=0, description="seconds between bytes from the upstream")
    warmup: bool = Field(default=True, description="load the proxy model at start-up (in the background)")
    trust_remote_code: bool = Field(default=False, description="let transformers run a hub model's own code")
    # security
    api_key: SecretStr | None = Field(
        default=None, description="when set, clients must present this proxy key (never logged, never forwarded)"
    )
    log_bodies: bool = Field(default=False, description="log request/response bodies (credentials redacted)")

    @field_validator("upstream")
    @classmethod
    def _url(cls, v: str) -> str:
        v = v.strip()
        if not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"must be an http(s) URL such as http://localhost:8080/v1, got {v!r}")
        return v.rstrip("/")

    @field_validator("api_key", "upstream_api_key")
    @classmethod
    def _key(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and (not v.get_secret_value() or v.get_secret_value() != v.get_secret_value().strip()):
            raise ValueError("must be a non-empty key without surrounding whitespace")
        if v is not None and not v.get_secret_value().isprintable():
            raise ValueError("must be printable characters")
        return v

    @field_validator("document_tag")
    @classmethod
    def _tag(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_.:-]*", v):
            raise ValueError(f"must be a tag name such as 'document', got {v!r}")
        return v

    @field_validator("ordering")
    @classmethod
    def _ordering(cls, v: str) -> str:
        from rag_opt.pipeline import ORDERINGS

        if v not in ORDERINGS:
            raise ValueError(f"unknown ordering {v!r}; use one of {', '.join(ORDERINGS)}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _default_budget(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and all(data.get(k) is None for k in _BUDGET_FIELDS):
            data = {**data, "ratio": DEFAULT_RATIO}
        return data

    @model_validator(mode="after")
    def _one_budget(self) -> ProxySettings:
        given = [k for k in _BUDGET_FIELDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of ratio, target_tokens and threshold (got {' and '.join(given)})")
        return self

    @property
    def budget(self) -> dict[str, Any]:
        """The default budget as keyword arguments of ``ContextOptimizer.optimize``."""
        return {k: getattr(self, k) for k in _BUDGET_FIELDS}

    @classmethod
    def from_sources(cls, cli: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> ProxySettings:
        """Build settings from command-line values (None = not given) over ``RAG_OPT_*`` environment variables.

        A budget given on the command line replaces any budget from the environment. Raises ``ValueError``
        with one readable line per invalid setting, naming where it came from.
        """
        env = os.environ if env is None else env
        data: dict[str, Any] = {}
        origin: dict[str, str] = {}
        for name in cls.model_fields:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None and raw.strip() != "":
                data[name] = raw.strip()
                origin[name] = ENV_PREFIX + name.upper()
        cli_values = {k: v for k, v in (cli or {}).items() if v is not None}
        if any(k in cli_values for k in _BUDGET_FIELDS):
            for k in _BUDGET_FIELDS:
                data.pop(k, None)
        for k, v in cli_values.items():
            data[k] = v
            origin[k] = _CLI_FLAGS.get(k, "--" + k.replace("_", "-"))
        if "upstream" not in data:
            raise ValueError("no upstream: pass --upstream URL or set RAG_OPT_UPSTREAM (e.g. http://localhost:8080/v1)")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            lines = []
            for err in exc.errors():
                field = str(err["loc"][0]) if err["loc"] else ""
                where = f"{field} (from {origin[field]})" if field in origin else field or "settings"
                lines.append(f"invalid {where}: {err['msg'].removeprefix('Value error, ')}")
            raise ValueError("; ".join(lines)) from None
