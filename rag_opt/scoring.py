"""The *score* stage: one proxy forward pass → unit relevance (probe) and document relevance.

With a probe for the proxy model (shipped for the embedded default, or passed explicitly), unit scores are
the probe's probabilities. Without one, rag-opt falls back to raw attention — the mean over layers and heads
of the question tokens' attention to the unit, relative to uniform — and says so (``method ==
"raw-attention"``). Document relevance is the best unit score of the document.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from rag_opt.attention import AttentionFeatures, extract
from rag_opt.features import ContextUnits, build_features
from rag_opt.probe import Probe, shipped_probe

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.proxy import ProxyModel

logger = logging.getLogger(__name__)


@dataclass
class Scores:
    unit: np.ndarray  # (n_units,) over all units of the context, in prompt order
    doc: np.ndarray  # (n_docs,)
    method: str  # "probe" | "raw-attention"
    attention: AttentionFeatures


class AttentionScorer:
    """Scores the units of a context with the proxy model's attention and (when available) a probe."""

    def __init__(
        self, proxy: ProxyModel, probe: Probe | None | str = "auto", *, max_tokens: int = 2048
    ) -> None:
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

    @property
    def method(self) -> str:
        return "probe" if self.probe is not None else "raw-attention"

    def score(self, question: str, units: ContextUnits) -> Scores:
        attn = extract(self.proxy, units.docs, question, max_tokens=self.max_tokens)
        if self.probe is not None:
            feats = build_features(self.probe.layout, attn, question, units)
            unit_scores = self.probe.predict_proba(feats)
        else:
            unit_scores = attn.unit[:, 1].mean(axis=(1, 2)).astype(np.float64)
        doc_of = units.doc_of_unit
        cand = np.concatenate([np.asarray(c, dtype=bool) for c in units.candidate] or [np.zeros(0, bool)])
        doc = np.full(len(units.docs), -np.inf)
        for i in np.flatnonzero(cand):
            doc[doc_of[i]] = max(doc[doc_of[i]], unit_scores[i])
        doc[~np.isfinite(doc)] = 0.0
        return Scores(
            unit=np.asarray(unit_scores, dtype=np.float64), doc=doc, method=self.method, attention=attn
        )
