"""Settings of the OpenAI-compatible proxy, from command-line arguments and ``RAG_OPT_*`` environment variables.

Precedence: command line > environment > defaults. Every field ``name`` has the environment variable
``RAG_OPT_<NAME>`` (e.g. ``RAG_OPT_UPSTREAM``, ``RAG_OPT_RATIO``, ``RAG_OPT_UPSTREAM_API_KEY``,
``RAG_OPT_PROXY_MODEL`` — the same variable the library reads for its default proxy model) and the command-line
flag ``--<name>`` with dashes, or a flag of its own: ``--proxy-model`` is ``--model``, and the encoding cache's
``encoding_cache``, ``encoding_cache_bytes`` and ``encoding_cache_dir`` are ``--no-cache``, ``--cache-bytes`` and
``--cache-dir`` (their variables ``RAG_OPT_ENCODING_CACHE``, ``RAG_OPT_ENCODING_CACHE_BYTES`` and
``RAG_OPT_ENCODING_CACHE_DIR``: ``RAG_OPT_CACHE_DIR`` is rag-opt's general cache folder). A boolean that is on by
default is turned off by ``--no-<name>``. A variable set to an empty value counts as unset, except a key
(``RAG_OPT_API_KEY``, ``RAG_OPT_UPSTREAM_API_KEY``): an empty one is refused, as ``--api-key ""`` is.
:func:`rag_opt.server.settings_cli.add_settings_arguments` generates the flags from the model's fields, and
:func:`rag_opt.server.settings_cli.settings_from_args` reads them back.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from rag_opt.errors import ConfigurationError
from rag_opt.models.cache_disk import DEFAULT_DISK_BYTES
from rag_opt.models.decoded_entries import DEFAULT_DECODED_BYTES
from rag_opt.models.encoding_cache import DEFAULT_CACHE_BYTES
from rag_opt.models.kv_codec import DEFAULT_FORMAT, FORMATS
from rag_opt.options import BUDGET_FIELDS, OptimizerOptions
from rag_opt.server.option_settings import options_settings_model, settings_options
from rag_opt.server.setting_fields import base_type, field_extra
from rag_opt.server.settings_checks import (
    check_cache_dir,
    check_cache_format,
    check_cache_namespace,
    check_cache_url,
    check_gemini_root,
    check_hosts,
    check_key,
    check_networks,
    check_proxy_key,
    check_tag,
    check_targets,
    check_threads,
    check_url,
)
from rag_opt.types import DEFAULT_RATIO, Budget
from rag_opt.wire.settings import WireSettings
from rag_opt.work import DEFAULT_LIMITS

__all__ = ["BUDGET_FIELDS", "ENV_PREFIX", "ProxySettings", "base_type", "cli_flag", "field_extra"]

ENV_PREFIX = "RAG_OPT_"
_SECRETS = ("api_key", "upstream_api_key", "gemini_upstream_api_key")
# the worker pool's defaults per encoding (--max-queue, --max-batch): under parallel encoding a request over cached
# documents costs its question pass, and queued questions share one (benchmarks/load.py, 64 clients); a joint
# forward is compute-bound, so a batch costs about the sum of its jobs and a long queue only waits
PARALLEL_QUEUE, PARALLEL_BATCH = 64, 16
JOINT_QUEUE, JOINT_BATCH = 8, 4


if TYPE_CHECKING:  # pragma: no cover - its fields are generated: typed code reads them as ProxySettings.options
    _OptimizerSettings = BaseModel
else:
    _OptimizerSettings = options_settings_model()


class ProxySettings(_OptimizerSettings):
    """Configuration of ``rag-opt serve``; each field's description is its command-line help.

    The optimizer's options (``ratio``, ``ordering``, ``language``, ``proxy_model`` for ``model``, ...) are settings
    generated from :class:`~rag_opt.options.OptimizerOptions` (:mod:`rag_opt.server.option_settings`); typed code
    reads them as :attr:`options`. The server sets its own way the ones it does not take (``threads``: its own
    setting here; the encoding cache: ``encoding_cache*``; ``tier``, ``limits`` and ``over_limit``: per request).

    The compression budget is one of ``ratio`` (default 0.5 when none is given), ``target_tokens`` or
    ``threshold``; a request may override it (``rag_opt`` field or ``x-ragopt-*`` headers).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    upstream: str = Field(description="the upstream's OpenAI base URL, e.g. http://localhost:8080/v1 (required)")
    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on")
    upstream_api_key: SecretStr | None = Field(
        default=None,
        description="replace the clients' credentials (Authorization, api-key, x-api-key, x-goog-api-key) with this "
        "key on the --upstream's paths; never logged",
    )
    gemini_upstream: str = Field(
        default="https://generativelanguage.googleapis.com",
        description="the Gemini API's root URL (without /v1beta): /v1beta/... and the model methods of /v1 "
        "(/v1/models/MODEL:generateContent...) go there",
    )
    gemini_upstream_api_key: SecretStr | None = Field(
        default=None,
        description="replace the clients' credentials (x-goog-api-key, ?key=, Authorization...) with this key, sent as "
        "x-goog-api-key, on the Gemini API's paths (--upstream-api-key never goes there); never logged",
    )
    # compression: the optimizer's options are generated settings (rag_opt.server.option_settings)
    allowed_targets: str | None = Field(
        default=None,
        description="comma-separated tokenizers a /v1/compress request may name as its target, matched as written "
        "(an OpenAI model name also when its encoding is listed): tiktoken encoding or OpenAI model names, "
        "hf:<id or folder>. Each loads once, at start-up (on first use with --no-warmup); any other name is "
        "refused before anything loads (default: o200k_base and cl100k_base, bundled for offline use; --target "
        "is always allowed)",
        json_schema_extra={"metavar": "TARGETS"},
    )
    encoding_cache: bool = Field(
        default=True,
        description="keep the document encodings of parallel encoding in one cache shared by every request and "
        "worker of the process (--cache-bytes in memory, --cache-dir on disk)",
        json_schema_extra={"flag": "--no-cache"},
    )
    encoding_cache_bytes: int = Field(
        default=DEFAULT_CACHE_BYTES,
        ge=0,
        description="bound of the encoding cache's memory tier in bytes, least recently used evicted first (0: no "
        "memory tier; with no --cache-dir either, no cache)",
        json_schema_extra={"flag": "--cache-bytes", "metavar": "BYTES"},
    )
    encoding_cache_dir: str | None = Field(
        default=None,
        description="folder of the encoding cache's disk tier, shared by workers and processes and filled ahead by "
        "'rag-opt index' (default: none, memory only)",
        json_schema_extra={"flag": "--cache-dir", "metavar": "DIR"},
    )
    encoding_cache_disk_bytes: int = Field(
        default=DEFAULT_DISK_BYTES,
        ge=1,
        description="bound of the disk tier (--cache-dir) in bytes, least recently used evicted first",
        json_schema_extra={"flag": "--cache-disk-bytes", "metavar": "BYTES"},
    )
    encoding_cache_url: str | None = Field(
        default=None,
        description="a shared tier on Redis or Valkey (redis://host:port/db, rediss://, unix://, valkey://), shared "
        "by every replica: a document one replica read is a cache hit for the others. Entries carry --cache-ttl and "
        "the store's own memory policy evicts; a store that is down or slow costs a recomputation, never an error",
        json_schema_extra={"flag": "--cache-url", "metavar": "URL"},
    )
    encoding_cache_ttl: float = Field(
        default=7 * 86400.0,
        gt=0,
        description="lifetime of a shared-tier (--cache-url) entry in seconds",
        json_schema_extra={"flag": "--cache-ttl", "metavar": "SECONDS"},
    )
    encoding_cache_timeout_ms: float = Field(
        default=50.0,
        gt=0,
        description="longest wait of a shared-tier (--cache-url) read, in ms: a slower store is a miss (the document "
        "is encoded) and is skipped for a few seconds",
        json_schema_extra={"flag": "--cache-timeout-ms", "metavar": "MS"},
    )
    encoding_cache_format: str = Field(
        default=DEFAULT_FORMAT,
        description="how cached keys and values are stored (docs/operations.md gives each format's bytes per token "
        "and quality): bf16 (the model's dtype, unchanged), int8, or kNvM (keys in N bits, values in M; g, h, w, q: "
        "rag_opt.models.kv_codec)",
        json_schema_extra={"flag": "--cache-format", "choices": list(FORMATS)},
    )
    encoding_cache_decoded_bytes: int = Field(
        default=DEFAULT_DECODED_BYTES,
        ge=0,
        description="bound in bytes of the decoded copies of compact entries kept for the documents read last (in the "
        "model's dtype, least recently read evicted): a document read again is copied, not decoded (0: decode "
        "every read; unused with --cache-format bf16)",
        json_schema_extra={"flag": "--cache-decoded-bytes", "metavar": "BYTES"},
    )
    cache_namespace: str = Field(
        default="none",
        description="keep tenants' cache entries apart: none (one cache for all), api-key (one namespace per client "
        "key) or header:NAME (per value of the request header NAME); a tenant's documents are never a cache hit "
        "for another",
        json_schema_extra={"metavar": "MODE"},
    )
    expose_cache_hits: bool = Field(
        default=False,
        description="report per-request cache hits and misses to clients (x-ragopt-cache-hits, cache_hits): they "
        "tell a client whether anyone sent a document recently, so they are off unless tenants are namespaced "
        "or trusted (docs/operations.md)",
    )
    # where context is found
    document_tag: str = Field(
        default="document",
        description="context documents are <TAG ...>...</TAG> blocks",
        json_schema_extra={"metavar": "TAG"},
    )
    tool_messages: bool = Field(default=True, description="optimize large tool/function result messages")
    tool_min_chars: int = Field(default=2000, ge=1, description="a tool message is context from this many characters")
    # behaviour
    time_budget_ms: float = Field(
        default=10_000.0,
        gt=0,
        description="time budget of one request's optimization: past it the lexical tier answers with what is left "
        "(at least a twentieth of the budget), or, with --no-lexical-tier, the request is forwarded unoptimized",
    )
    max_concurrency: int = Field(default=1, ge=1, description="optimizations running at once (worker threads)")
    max_queue: int | None = Field(
        default=None,
        ge=0,
        description="optimizations that may wait for a worker; beyond: overload (default: 64 under parallel encoding, "
        "whose requests over cached documents are short and batch well; 8 under joint encoding)",
    )
    max_lexical_queue: int = Field(
        default=256,
        ge=0,
        description="lexical-tier optimizations (milliseconds each) that may wait for one of its workers, a worker "
        "per core; beyond, or when the estimated wait exceeds the time budget: overload",
    )
    on_overload: Literal["fail-open", "reject"] = Field(
        default="fail-open",
        description="when the optimizer is overloaded: forward unoptimized (fail-open) or answer 429 (reject)",
    )
    lexical_tier: bool = Field(
        default=True,
        description="when the proxy model is overloaded, still loading or over its time budget, or the context is "
        "over --lexical-over-tokens, optimize with the lexical tier (BM25 and lexical features, milliseconds) "
        "instead of forwarding unoptimized",
    )
    lexical_over_tokens: int | None = Field(
        default=None,
        ge=1,
        description="contexts of more target tokens than this go to the lexical tier, not the proxy model "
        "(default: never)",
        json_schema_extra={"metavar": "TOKENS"},
    )
    batch_wait_ms: float = Field(
        default=5.0,
        ge=0,
        description="a worker that takes an optimization waits this long for more queued with the same settings, "
        "to run them as one batch (0: only those already queued)",
    )
    max_batch: int | None = Field(
        default=None,
        ge=1,
        description="most optimizations run as one batch (1: no batching; default: 16 under parallel encoding, where "
        "queued questions share one question pass over the cached documents; 4 under joint encoding, whose passes "
        "are compute-bound)",
    )
    threads: str = Field(
        default="adaptive",
        description="CPU threads per forward pass: 'adaptive' (only the cores free right now: fastest on a shared "
        "CPU, scores vary in their last digits with the load), 'auto' (the workers share the cores, fixed) or a number",
    )
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1, description="larger request bodies get a 413")
    optimizer_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="run the optimizer threads this much lower in CPU priority than request handling (Linux; 0: off)",
    )
    max_documents: int = Field(
        default=1000, ge=1, description="a request with more context documents is forwarded unoptimized, never queued"
    )
    max_units: int = Field(
        default=DEFAULT_LIMITS.max_units or 20_000,
        ge=1,
        description="an optimization stops after segmentation when the context has more units (sentences, ...)",
    )
    max_proxy_tokens: int = Field(
        default=DEFAULT_LIMITS.max_proxy_tokens or 65_536,
        ge=1,
        description="an optimization stops before the proxy model runs when the context has more of its tokens "
        "(the question counted once per forward pass it goes into)",
    )
    max_question_tokens: int = Field(
        default=DEFAULT_LIMITS.max_question_tokens or 1024,
        ge=1,
        description="an optimization stops before segmentation when the question has more target tokens (a "
        "question of more than 32 characters per token of this is over it without being counted)",
    )
    header_timeout: float = Field(
        default=10.0, gt=0, description="seconds a client has to send a request's headers; then a 408, and it is closed"
    )
    body_timeout: float = Field(
        default=60.0,
        gt=0,
        description="seconds a client has to send a request's whole body once its headers are in; then a 408",
    )
    max_connections: int = Field(
        default=1000,
        ge=1,
        description="open client connections; more are refused at once with a 503 (lowered to fit the open-file limit)",
    )
    trusted_proxies: str | None = Field(
        default=None,
        description="comma-separated addresses or networks (CIDR) of proxies in front whose X-Forwarded-For, "
        "X-Real-IP and Forwarded headers are kept; from other peers they are replaced",
        json_schema_extra={"metavar": "NETWORKS"},
    )
    connect_timeout: float = Field(default=10.0, gt=0, description="seconds to connect to the upstream")
    read_timeout: float = Field(default=600.0, gt=0, description="seconds between bytes from the upstream")
    warmup: bool = Field(default=True, description="load the proxy model at start-up, in the background")
    # security
    api_key: SecretStr | None = Field(
        default=None,
        description="proxy access key: clients send 'Authorization: Bearer KEY', 'X-RagOpt-Api-Key: KEY' or "
        "'X-Headroom-Proxy-Token: KEY' (on the Gemini API's paths also 'x-goog-api-key: KEY' or ?key=KEY: the "
        "Gemini SDK's api_key); never logged, never forwarded",
    )
    log_bodies: bool = Field(default=False, description="log request and response bodies, credentials redacted")
    allowed_hosts: str | None = Field(
        default=None,
        description="comma-separated host names the proxy answers to besides its listen address (in Host, checked "
        "against DNS rebinding): a name, .example.com for it and its subdomains, or * for any (default: the listen "
        "address; on loopback or 0.0.0.0/:: also localhost, 127.0.0.1 and ::1; on 0.0.0.0/:: any IP address)",
        json_schema_extra={"metavar": "HOSTS"},
    )
    send_timeout: float = Field(
        default=60.0,
        gt=0,
        description="seconds a client may leave an answer unread (the proxy's send buffer full); then its connection "
        "is closed",
    )
    # observability
    otel: bool = Field(
        default=False,
        description="record an OpenTelemetry span (rag_opt.optimize) per optimized request, a child of its W3C "
        "traceparent, with tokens, ratio, status, reason, tier, cache hits and stage timings; exporters from the "
        "standard OTEL_* variables (OTLP by default; needs the otel extra)",
    )

    @property
    def queue_bound(self) -> int:
        """``max_queue``, or its default for the encoding."""
        if self.max_queue is not None:
            return self.max_queue
        return PARALLEL_QUEUE if self.options.encoding == "parallel" else JOINT_QUEUE

    @property
    def batch_bound(self) -> int:
        """``max_batch``, or its default for the encoding."""
        if self.max_batch is not None:
            return self.max_batch
        return PARALLEL_BATCH if self.options.encoding == "parallel" else JOINT_BATCH

    _url = field_validator("upstream", "gemini_upstream")(check_url)
    _gemini_root = field_validator("gemini_upstream")(check_gemini_root)
    _networks = field_validator("trusted_proxies")(check_networks)
    _key = field_validator("api_key", "upstream_api_key", "gemini_upstream_api_key")(check_key)
    _proxy_key = field_validator("api_key")(check_proxy_key)
    _hosts = field_validator("allowed_hosts")(check_hosts)
    _targets = field_validator("allowed_targets")(check_targets)
    _tag = field_validator("document_tag")(check_tag)
    _threads = field_validator("threads")(check_threads)
    _cache_dir = field_validator("encoding_cache_dir")(check_cache_dir)
    _cache_url = field_validator("encoding_cache_url")(check_cache_url)
    _cache_format = field_validator("encoding_cache_format")(check_cache_format)
    _cache_namespace = field_validator("cache_namespace")(check_cache_namespace)

    @model_validator(mode="before")
    @classmethod
    def _default_budget(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and all(data.get(k) is None for k in BUDGET_FIELDS):
            data = {**data, "ratio": DEFAULT_RATIO}
        return data

    @model_validator(mode="after")
    def _one_budget(self) -> ProxySettings:
        _ = self.budget  # at most one of ratio, target_tokens and threshold
        return self

    @property
    def budget(self) -> Budget:
        """The default budget (a request may give its own)."""
        return Budget(**{k: getattr(self, k) for k in BUDGET_FIELDS})

    @cached_property
    def options(self) -> OptimizerOptions:
        """The optimizer's options these settings give (:func:`~rag_opt.server.option_settings.settings_options`):
        the server's optimizer is built from them, with the server's own ``threads`` and encoding cache."""
        return settings_options(self)

    @cached_property
    def wire(self) -> WireSettings:
        """What the transport-free core reads of these settings (:mod:`rag_opt.wire`): where context is found, and
        a request's default budget and ordering (its language and target tokenizer: the optimizer's own)."""
        return WireSettings(
            document_tag=self.document_tag,
            tool_messages=self.tool_messages,
            tool_min_chars=self.tool_min_chars,
            budget=self.budget,
            ordering=self.options.ordering,
            expose_cache_hits=self.expose_cache_hits,
        )

    @classmethod
    def from_sources(cls, cli: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> ProxySettings:
        """Build settings from command-line values (None = not given) over ``RAG_OPT_*`` environment variables.

        A budget given on the command line replaces any budget from the environment. Raises
        :class:`~rag_opt.errors.ConfigurationError` (a ``ValueError``) with one readable line per invalid
        setting, naming where it came from.
        """
        env = os.environ if env is None else env
        data: dict[str, Any] = {}
        origin: dict[str, str] = {}
        for name in cls.model_fields:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None and raw.strip() == "" and name in _SECRETS:  # as --api-key "" is: refused
                raise ConfigurationError(
                    f"{ENV_PREFIX}{name.upper()} is set but empty: an empty key cannot be used (and would silently "
                    "turn it off); unset the variable or give the key"
                )
            if raw is not None and raw.strip() != "":
                data[name] = raw.strip()
                origin[name] = ENV_PREFIX + name.upper()
        cli_values = {k: v for k, v in (cli or {}).items() if v is not None}
        if any(k in cli_values for k in BUDGET_FIELDS):
            for k in BUDGET_FIELDS:
                data.pop(k, None)
        for k, v in cli_values.items():
            data[k] = v
            origin[k] = cli_flag(k) if k in cls.model_fields else k
        if "upstream" not in data:
            raise ConfigurationError(
                "no upstream: pass --upstream URL or set RAG_OPT_UPSTREAM (e.g. http://localhost:8080/v1)"
            )
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            lines = []
            for err in exc.errors():
                field = str(err["loc"][0]) if err["loc"] else ""
                where = f"{field} (from {origin[field]})" if field in origin else field or "settings"
                lines.append(f"invalid {where}: {err['msg'].removeprefix('Value error, ')}")
            raise ConfigurationError("; ".join(lines)) from None


# -- the names of the flags (rag_opt.server.settings_cli generates them) -------------------------------------------
def cli_flag(name: str) -> str:
    """The command-line flag of setting ``name``: ``--<name>`` with dashes, ``--no-<name>`` for a boolean that
    is on by default, or the field's own (``--model`` for ``proxy_model``)."""
    info = ProxySettings.model_fields[name]
    flag = field_extra(info).get("flag")
    if isinstance(flag, str):
        return flag
    dashed = name.replace("_", "-")
    return f"--no-{dashed}" if base_type(info.annotation) is bool and info.default is True else f"--{dashed}"
