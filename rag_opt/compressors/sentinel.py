"""Sentinel-style scoring: one proxy forward pass → unit relevance (probe) and document relevance.

With a probe for the proxy model (shipped for the embedded default, or passed explicitly), unit scores are
the probe's probabilities. Without one, rag-opt falls back to raw attention — the mean over layers and heads
of the question tokens' attention to the unit, relative to uniform — and says so (``method ==
"raw-attention"``). Document relevance is the best unit score of the document.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.attention import extract
from rag_opt.compressors.base import Scores, doc_scores_from_units
from rag_opt.features import ContextUnits, build_features
from rag_opt.probe import Probe, shipped_probe

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.proxy import ProxyModel

logger = logging.getLogger(__name__)


class SentinelCompressor:
    """Scores the units of a context with the proxy model's attention and (when available) a probe.

    The default scorer of :class:`rag_opt.ContextOptimizer`; selection under the budget is shared by all
    scorers (:mod:`rag_opt.compressors.selection`). Build it from a loaded proxy (:func:`rag_opt.proxy.load_proxy`)
    or with :meth:`from_model`.
    """

    def __init__(self, proxy: ProxyModel, probe: Probe | None | str = "auto", *, max_tokens: int = 2048) -> None:
        self.proxy = proxy
        self.max_tokens = max_tokens
        if probe == "auto":
            probe = shipped_probe(proxy.name)
            if probe is None:
                logger.warning(
                    "no probe is shipped for proxy model %s: scoring with raw attention (weaker); train one "
                    "with `rag-opt train-probe`",
                    proxy.name,
                )
        elif isinstance(probe, str):
            probe = Probe.load(probe)
        if probe is not None:
            probe.check_compatible(proxy.name, proxy.num_layers, proxy.num_heads)
        self.probe: Probe | None = probe

    @classmethod
    def from_model(
        cls,
        model: str | None = None,
        *,
        probe: Probe | None | str = "auto",
        device: str | None = None,
        dtype: str | None = None,
        max_tokens: int = 2048,
        trust_remote_code: bool = False,
    ) -> SentinelCompressor:
        from rag_opt.proxy import load_proxy

        proxy = load_proxy(model, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
        return cls(proxy, probe, max_tokens=max_tokens)

    @property
    def method(self) -> str:
        return "probe" if self.probe is not None else "raw-attention"

    @property
    def model_name(self) -> str:
        return self.proxy.name

    def score(self, question: str, units: ContextUnits) -> Scores:
        attn = extract(self.proxy, units.docs, question, max_tokens=self.max_tokens)
        if self.probe is not None:
            feats = build_features(self.probe.layout, attn, question, units)
            unit_scores = self.probe.predict_proba(feats)
        else:
            unit_scores = attn.unit[:, 1].mean(axis=(1, 2)).astype(np.float64)
        unit = np.asarray(unit_scores, dtype=np.float64)
        return Scores(
            unit=unit, doc=doc_scores_from_units(unit, units), method=self.method, model=self.proxy.name, attention=attn
        )
