"""LiteLLM: rag-opt as a ``pre_call`` guardrail of the LiteLLM proxy. It optimizes the retrieved context of a
request before LiteLLM sends it upstream, with the conventions of ``rag-opt serve``: ``<document ...>`` blocks,
large tool results of the current turn, and the ``rag_opt`` extension field (its ``documents`` and per-request
options; the field itself never goes upstream). Registered in the proxy's ``config.yaml``::

    guardrails:
      - guardrail_name: rag-opt
        litellm_params:
          guardrail: rag_opt.adapters.litellm.RagOptGuardrail
          mode: pre_call
          default_on: true
          ratio: 0.5

It reads chat completions (``/v1/chat/completions``) and Anthropic messages (``/v1/messages``); other calls pass
through untouched. Its options are the guardrail's ``litellm_params`` (:class:`GuardrailSettings`; an unknown name
is refused at start-up, naming the closest known one): ``backend`` (``in_process``: a
:class:`rag_opt.ContextOptimizer` in LiteLLM's process, built from any of its options such as ``model`` or
``device``; ``sidecar``: ``rag-opt serve``'s ``POST /v1/compress`` at ``sidecar_url``), the budget (``ratio`` |
``target_tokens`` | ``threshold``), ``ordering``, ``target``, ``language``, ``timeout``, ``fail_closed`` and the
others of :class:`~rag_opt.adapters.gateway.GatewaySettings`. A request overrides the budget, ordering and language
as on the proxy (the ``rag_opt`` field, the ``x-ragopt-*`` headers), and bypasses the guardrail with
``{"rag_opt": {"enabled": false}}`` or ``x-ragopt-disable: true``.

Fail-open by default: when the optimizer or the sidecar fails the request goes on unoptimized, with a warning; with
``fail_closed: true`` LiteLLM refuses it (503). An invalid ``rag_opt`` field or ``x-ragopt-*`` header is a 400.
Both are :class:`~rag_opt.adapters.gateway.GatewayError` s, which LiteLLM answers in its own error shape. What
happened (status, tokens before and after, milliseconds, reason) goes into LiteLLM's guardrail logging
(``standard_logging_object["guardrail_information"]``, provider :data:`PROVIDER`) and into the ``x-ragopt-*``
response headers. The guardrail only translates between LiteLLM and :class:`~rag_opt.adapters.gateway.RequestOptimizer`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationError

from rag_opt.adapters.gateway import API, EXTENSION_FIELD, OWNED, GatewayError, GatewaySettings, RequestOptimizer
from rag_opt.errors import ConfigurationError
from rag_opt.install import install_hint

try:
    from litellm.integrations.custom_guardrail import CustomGuardrail
    from litellm.types.guardrails import GuardrailEventHooks
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"rag_opt.adapters.litellm needs LiteLLM's proxy: {install_hint('litellm')}") from exc

if TYPE_CHECKING:  # pragma: no cover
    from litellm.types.utils import GenericGuardrailAPIInputs

    from rag_opt.wire.flow import Outcome

__all__ = ["PROVIDER", "GatewayError", "GuardrailSettings", "RagOptGuardrail", "split_kwargs"]

logger = logging.getLogger(__name__)

PROVIDER = "rag_opt"  # the guardrail_provider of its entries in LiteLLM's guardrail logging
_CALLS: dict[str, API] = {"completion": "chat", "acompletion": "chat", "anthropic_messages": "anthropic"}
_ALIASES = {"api_base": "sidecar_url", "api_key": "sidecar_api_key"}  # LiteLLM's names for a provider's URL, key
_NOT_RUN = frozenset({"disabled", "no_context", "no_query"})
_LOG_KEY = "standard_logging_guardrail_information"


class GuardrailSettings(GatewaySettings):
    """The guardrail's options: :class:`~rag_opt.adapters.gateway.GatewaySettings` and its own."""

    response_headers: bool = Field(default=True, description="send the x-ragopt-* response headers")


def split_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], GuardrailSettings]:
    """The keyword arguments LiteLLM passes a guardrail: those for ``CustomGuardrail`` and the validated
    :class:`GuardrailSettings` (``ContextOptimizer`` options go into its ``optimizer``). The parameters LiteLLM
    fills in for every guardrail are ignored; any other unknown name is a
    :class:`~rag_opt.errors.ConfigurationError` naming the closest known one, as is an invalid value."""
    from rag_opt.adapters.options import optimizer_options

    base_names = set(inspect.signature(CustomGuardrail.__init__).parameters) - {"self", "kwargs"}
    try:
        from litellm.types.guardrails import LitellmParams

        litellm_names = set(LitellmParams.model_fields)
    except ImportError:  # pragma: no cover - another LiteLLM version
        litellm_names = set()
    fields, options = set(GuardrailSettings.model_fields) - {"optimizer"}, set(optimizer_options()) - {"scorer"}
    base: dict[str, Any] = {}
    ours: dict[str, Any] = {"optimizer": {}}
    unknown = []
    for name, value in kwargs.items():
        if name in fields or name in _ALIASES:
            ours[_ALIASES.get(name, name)] = value
        elif name in options:
            ours["optimizer"][name] = value
        elif name in base_names:
            base[name] = value
        elif name not in litellm_names:
            unknown.append(name)
    if "timeout" in ours:
        base["timeout"] = ours["timeout"]
    if unknown:
        choices = sorted(fields | options | set(_ALIASES))
        hints = [
            n + "".join(f" (did you mean {c}?)" for c in difflib.get_close_matches(n, choices, 1)) for n in unknown
        ]
        raise ConfigurationError(f"rag-opt guardrail: unknown option {', '.join(hints)}; it takes {', '.join(choices)}")
    try:
        return base, GuardrailSettings.model_validate(ours)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "options"
        raise ConfigurationError(f"rag-opt guardrail: {where}: {err['msg'].removeprefix('Value error, ')}") from None


class RagOptGuardrail(CustomGuardrail):
    """rag-opt as a LiteLLM ``pre_call`` guardrail (see the module docstring). LiteLLM builds it from its config;
    in Python: ``RagOptGuardrail(guardrail_name="rag-opt", event_hook="pre_call", default_on=True, ratio=0.5)``."""

    records_own_guardrail_information = True  # one entry per request, with the tokens (not LiteLLM's generic one)

    def __init__(self, **kwargs: Any) -> None:
        base, self.settings = split_kwargs(kwargs)
        base.setdefault("supported_event_hooks", [GuardrailEventHooks.pre_call])
        super().__init__(**base)
        self.optimizer = RequestOptimizer(self.settings)

    def structured_messages_cover_full_request(self) -> bool:
        return True  # the chat messages it returns are the whole conversation

    async def apply_guardrail(
        self,
        inputs: GenericGuardrailAPIInputs,
        request_data: dict[str, Any],
        input_type: Literal["request", "response"],
        logging_obj: Any = None,
    ) -> GenericGuardrailAPIInputs:
        """Optimize the request's context in place (``request_data``: the request LiteLLM is about to send)."""
        if input_type != "request" or (api := _api_of(request_data, logging_obj)) is None:
            return inputs
        t0 = time.time()
        outcome, body = await self.optimizer.rewrite(api, request_data, _ragopt_headers(request_data))
        self._record(request_data, outcome, t0, time.time())
        request_data.pop(EXTENSION_FIELD, None)  # rag-opt's own field never goes upstream
        if body is None:
            return inputs
        for key in OWNED[api]:
            if key in body:
                request_data[key] = body[key]
            else:
                request_data.pop(key, None)
        rest = {k: v for k, v in inputs.items() if k not in ("texts", "tools")}  # nothing else to write back
        if api == "chat":
            return {**rest, "structured_messages": request_data["messages"]}  # type: ignore[typeddict-item]
        return rest  # type: ignore[return-value]  # (Anthropic: written in place; LiteLLM's write-back is lossy)

    async def async_post_call_response_headers_hook(
        self,
        data: dict[str, Any],
        user_api_key_dict: Any,
        response: Any,
        request_headers: dict[str, str] | None = None,
        litellm_call_info: dict[str, object] | None = None,
    ) -> dict[str, str] | None:
        """The ``x-ragopt-*`` headers of the request's outcome (as ``rag-opt serve`` sends them)."""
        if not self.settings.response_headers or (report := self._report_of(data)) is None:
            return None
        from rag_opt.wire.flow import Outcome

        fields = {f.name for f in dataclasses.fields(Outcome)}
        outcome = Outcome(**{k: v for k, v in report.items() if k in fields})
        return {k.decode(): v.decode() for k, v in outcome.headers()}

    def _record(self, data: dict[str, Any], outcome: Outcome, t0: float, t1: float) -> None:
        """``outcome`` into LiteLLM's guardrail logging (read back for the response headers)."""
        status: Literal["success", "guardrail_failed_to_respond", "not_run"] = "success"
        if outcome.status == "fail_open":
            status = "guardrail_failed_to_respond"
        elif outcome.status in _NOT_RUN:
            status = "not_run"
        self.add_standard_logging_guardrail_information_to_request_data(
            guardrail_json_response={**dataclasses.asdict(outcome), "backend": self.settings.backend},
            request_data=data,
            guardrail_status=status,
            guardrail_provider=PROVIDER,
            start_time=t0,
            end_time=t1,
            duration=t1 - t0,
            event_type=GuardrailEventHooks.pre_call,
        )
        if status != "not_run":  # LiteLLM's x-litellm-applied-guardrails response header
            from litellm.proxy.common_utils.callback_utils import add_guardrail_to_applied_guardrails_header

            add_guardrail_to_applied_guardrails_header(request_data=data, guardrail_name=self.guardrail_name)

    def _report_of(self, data: Mapping[str, Any]) -> dict[str, Any] | None:
        """This guardrail's latest report in the request's guardrail logging (None: it did not run)."""
        for bucket in (data.get("metadata"), data.get("litellm_metadata")):
            entries = bucket.get(_LOG_KEY) if isinstance(bucket, Mapping) else None
            for entry in reversed(entries if isinstance(entries, list) else []):
                if entry.get("guardrail_provider") == PROVIDER and entry.get("guardrail_name") == self.guardrail_name:
                    report = entry.get("guardrail_response")
                    return report if isinstance(report, dict) else None
        return None


def _api_of(data: Mapping[str, Any], logging_obj: Any) -> API | None:
    """The API of the request (``chat`` or ``anthropic``), or None for a call the guardrail does not read."""
    call = getattr(logging_obj or data.get("litellm_logging_obj"), "call_type", None)
    if call is None:  # no logging object: by the route
        request = data.get("proxy_server_request")
        url = str(request.get("url", "")) if isinstance(request, Mapping) else ""
        call = "anthropic_messages" if url.rstrip("/").endswith("/messages") else "acompletion"
    return _CALLS.get(str(getattr(call, "value", call)))


def _ragopt_headers(data: Mapping[str, Any]) -> dict[str, str]:
    """The request's ``x-ragopt-*`` headers (its per-request options, as on the proxy)."""
    request = data.get("proxy_server_request")
    headers = request.get("headers") if isinstance(request, Mapping) else None
    items = headers.items() if isinstance(headers, Mapping) else ()
    return {str(k): str(v) for k, v in items if str(k).lower().startswith("x-ragopt-")}
