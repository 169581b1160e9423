"""The documents' language: validated once, followed by segmentation and by the BM25 stopwords."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rag_opt.cli import main
from rag_opt.compressors.baselines import BM25Scorer
from rag_opt.compressors.lexical import bm25_scores, term_overlap
from rag_opt.errors import InvalidInputError
from rag_opt.pipeline import ContextOptimizer
from rag_opt.text.language import STOPWORD_LANGUAGES, check_language, stopwords

GERMAN = [
    "Der Hund schläft im Garten und der Garten ist groß.",
    "Die Katze jagt eine Maus.",
    "Das ist usw. Okay.",
]


@pytest.mark.parametrize(("given", "code"), [("en", "en"), ("pt-BR", "pt-br"), ("zh_Hans", "zh-hans"), (" de ", "de")])
def test_language_codes_are_normalised(given, code):
    assert check_language(given) == code


@pytest.mark.parametrize("bad", ["", "e", "english!", "de DE", "12", 5, None])
def test_a_bad_language_is_a_clear_error(bad):
    with pytest.raises(InvalidInputError, match="language must be"):
        check_language(bad)
    with pytest.raises(InvalidInputError, match="language must be"):
        ContextOptimizer(language=bad)


def test_bm25_stopwords_follow_the_language():
    # "der" / "ist" are German stopwords but not English ones: only the German list ignores them
    question = "Wo ist der Hund?"
    en, de = bm25_scores(question, GERMAN, "en"), bm25_scores(question, GERMAN, "de")
    assert en[2] > 0 and de[2] == 0  # "Das ist usw." shares only the stopword "ist" with the question
    assert de[0] > 0 and de[1] == 0
    assert term_overlap(question, GERMAN, "de")[0] == 1.0  # "wo" and "hund" ("wo" is no stopword list's)
    assert "der" in stopwords("de") and "der" not in stopwords("en")
    assert stopwords("pt-br") == stopwords("pt")


def test_a_language_without_a_stopword_list_keeps_every_word():
    assert "ja" not in STOPWORD_LANGUAGES and stopwords("ja") == ()
    scores = bm25_scores("the cat", ["the dog", "a cat"], "ja")
    assert scores[0] > 0  # "the" counts without a stopword list
    assert np.all(bm25_scores("the cat", ["the dog", "a cat"], "en")[:1] == 0)


def test_the_optimizer_passes_its_language_to_segmentation_and_bm25():
    question = "Wo ist der Hund?"
    de = _by_index(ContextOptimizer(language="de", scorer=BM25Scorer()).optimize(question, GERMAN, ratio=0.5))
    en = _by_index(ContextOptimizer(language="en", scorer=BM25Scorer()).optimize(question, GERMAN, ratio=0.5))
    # German rules know "usw." (no sentence break after it); the default rules split there
    assert len(de[2].units) == 1 and len(en[2].units) == 2
    # and the German BM25 scores ignore the shared stopword
    assert de[2].score == 0 and en[2].score > 0


def _by_index(result):
    return {d.index: d for d in result.documents + result.dropped}


@pytest.mark.model
def test_cli_language_option(capsys, tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in GERMAN), encoding="utf-8")
    code = main(["optimize", "-q", "Wo schläft der Hund?", "-i", str(f), "--language", "de", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    units = {d["index"]: d["units"] for d in json.loads(out)["documents"] + json.loads(out)["dropped"]}
    assert len(units[2]) == 1
    code = main(["optimize", "-q", "Wo?", "-i", str(f), "--language", "de DE"])
    assert code == 2 and "language must be an ISO 639 code" in capsys.readouterr().err


def test_remembered_terms_equal_fresh_ones_per_language_and_stay_bounded(monkeypatch):
    """The lexical tokenizer's memo (the same documents come back with every question) returns what tokenizing
    afresh returns, keeps languages apart, hands out copies, and never holds more than its bound."""
    import bm25s

    from rag_opt.compressors import lexical

    texts = [f"The {w} river flows through the old town number {i}." for i, w in enumerate(["Rhine", "Main"] * 20)]
    fresh = [list(t) for t in bm25s.tokenize(texts, stopwords=list(stopwords("en")), return_ids=False)]
    assert lexical._tokens(texts, "en") == fresh
    assert lexical._tokens(texts[::-1], "en") == fresh[::-1]  # now from the memo, in the caller's order
    lexical._tokens(texts, "en")[0].append("mutated")  # callers get copies
    assert lexical._tokens(texts[:1], "en") == fresh[:1]
    assert lexical._tokens(["Die Stadt und der Fluss"], "de") != lexical._tokens(["Die Stadt und der Fluss"], "en")
    monkeypatch.setattr(lexical, "TOKEN_MEMO", 5)
    lexical._tokens([f"text number {i}" for i in range(50)], "en")
    assert len(lexical._memo) <= 5
