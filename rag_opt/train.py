"""Training the sentence-relevance probe on HotpotQA (``rag-opt train-probe``).

Examples: every HotpotQA question of the training file (shuffled with a fixed seed; ``limit`` takes a prefix).
Each paragraph is rendered as its title line followed by its sentences, exactly as the optimizer renders a
document with a title. Labels: a sentence is positive when it is a supporting fact or contains the answer
string (SQuAD-normalised; yes/no answers never mark sentences). Title units are not training examples (titles
are kept with their document). Questions whose answer is yes/no still contribute their supporting facts.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rag_opt.datasets import HotpotExample, read_hotpotqa
from rag_opt.feature_cache import FeatureCache, fill_cache

logger = logging.getLogger(__name__)


def hotpot_units(ex: HotpotExample) -> list[list[str]]:
    """A HotpotQA example's paragraphs as unit lists: ``[title line, sentence, sentence, ...]``."""
    return [[f"{title}\n", *sents] for title, sents in zip(ex.titles, ex.sentences, strict=True)]


def feature_cache_for(root: str | Path, model_name: str, dataset: str) -> FeatureCache:
    safe = model_name.replace(":", "-").replace("/", "-")
    return FeatureCache(Path(root) / safe / dataset)


def extract_hotpot(
    path: str | Path,
    cache_root: str | Path,
    *,
    model: str | None = None,
    limit: int | None = None,
    seed: int = 0,
    max_tokens: int = 2048,
    progress: bool = True,
) -> FeatureCache:
    """Compute (or reuse) attention features for HotpotQA examples and return their cache."""
    from rag_opt.attention import extract
    from rag_opt.proxy import load_proxy

    proxy = load_proxy(model)
    examples = read_hotpotqa(path, limit=limit, seed=seed)
    cache = feature_cache_for(cache_root, proxy.name, Path(path).name.split(".")[0])
    fill_cache(
        cache,
        [(ex.id, hotpot_units(ex), ex.question) for ex in examples],
        lambda docs, q: extract(proxy, docs, q, max_tokens=max_tokens),
        progress=progress,
        desc=f"features {Path(path).name}",
    )
    return cache
