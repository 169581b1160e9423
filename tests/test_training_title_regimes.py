"""Training in three title regimes (issue 24): a title field, the title as the text's first line, no title."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from rag_opt.errors import InvalidInputError
from rag_opt.training.units import assign_title_regimes, hotpot_table, parse_title_mix, regime_units


def _examples(n: int):
    from rag_opt.training.datasets import read_hotpotqa
    from tests.helpers import data_path

    return read_hotpotqa(data_path("hotpotqa", "dev.jsonl.gz"), seed=0, limit=n)


def test_a_title_mix_is_read_from_regime_share_pairs():
    assert parse_title_mix("field=0.6, none=0.4") == {"field": 0.6, "none": 0.4}
    assert parse_title_mix("text=1") == {"text": 1.0}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("field=0.6,none=0.3", "sum to 1"),
        ("field=0.5,title=0.5", "unknown title regime 'title'"),
        ("field=0.5,field=0.5", "given twice"),
        ("field=half,none=0.5", "not a number"),
        ("field", "not regime=share"),
        ("field=1.5,none=-0.5", r"in \[0, 1\]"),
        (" , ", "empty"),
    ],
)
def test_a_bad_title_mix_is_a_clear_error(text, message):
    with pytest.raises(InvalidInputError, match=message):
        parse_title_mix(text)


def test_regimes_are_assigned_in_their_shares_and_reproducibly():
    got = assign_title_regimes(101, {"field": 0.5, "none": 0.3, "text": 0.2}, seed=3)
    assert Counter(got) == {"field": 51, "none": 30, "text": 20}  # the largest share takes the rounding rest
    assert got == assign_title_regimes(101, {"field": 0.5, "none": 0.3, "text": 0.2}, seed=3)
    assert got != assign_title_regimes(101, {"field": 0.5, "none": 0.3, "text": 0.2}, seed=4)
    assert assign_title_regimes(5, {"field": 1.0}) == ["field"] * 5


def test_each_regimes_table_matches_its_labels_and_what_the_proxy_reads():
    from rag_opt.training.sentence_probe import regime_labels

    ex = _examples(1)[0]
    n_sentences = sum(len(s) for s in ex.sentences)
    for regime in ("field", "text", "none"):
        table = hotpot_table(ex, regime)
        labels = regime_labels(ex, regime)
        assert labels.shape == (table.n_units,)
        assert not labels[~table.candidate].any()  # a title row or heading line is never a positive
        assert int(table.candidate.sum()) == n_sentences  # every sentence is a candidate in every regime
        assert table.by_document() == regime_units(ex, regime)
    none = hotpot_table(ex, "none")
    assert "title" not in none.kind and none.n_units == n_sentences
    text = hotpot_table(ex, "text")
    assert "title" not in text.kind and text.kind.count("heading") == len(ex.titles)
    assert text.link_names == tuple(ex.titles)


def test_the_untitled_regime_links_documents_as_the_optimizer_does():
    """Training must see the link names a request without titles gets: the subject each text opens with."""
    from rag_opt.text.units import UnitTable
    from rag_opt.types import Document

    for ex in _examples(5):
        docs = [Document(id=t, text=ex.paragraph_text(p)) for p, t in enumerate(ex.titles)]
        runtime = UnitTable.build(docs, len)
        assert hotpot_table(ex, "none").link_names == runtime.link_names
        assert runtime.titles == (None,) * len(docs)


def test_the_titled_regimes_link_documents_as_the_optimizer_does():
    """A titled paragraph's salient subject names (its text opens with a subject other than its title) are the same
    in training tables as in a request with a title field or a heading line."""
    from rag_opt.text.units import UnitTable
    from rag_opt.types import Document

    examples = _examples(40)
    found = 0
    for ex in examples:
        field = [Document(id=t, title=t, text=ex.paragraph_text(p)) for p, t in enumerate(ex.titles)]
        heading = [Document(id=t, text=f"{t}\n{ex.paragraph_text(p)}") for p, t in enumerate(ex.titles)]
        for regime, docs in (("field", field), ("text", heading)):
            runtime = UnitTable.build(docs, len)
            if runtime.titles != tuple(ex.titles):  # a title the heading rule does not read as one: not comparable
                continue
            assert hotpot_table(ex, regime).link_spans == runtime.link_spans
        found += sum(1 for s in hotpot_table(ex, "field").link_spans if s)
    assert found > 0  # real paragraphs open with a subject other than their title


def test_the_text_regime_gives_the_lexical_probe_the_same_features_as_the_field():
    from rag_opt.compressors.features import lexical_features
    from rag_opt.compressors.lexical_scorer import word_counts

    ex = _examples(1)[0]
    field, text, none = (hotpot_table(ex, r) for r in ("field", "text", "none"))
    f = lexical_features(ex.question, field, word_counts(field))
    np.testing.assert_array_equal(f, lexical_features(ex.question, text, word_counts(text)))
    n = lexical_features(ex.question, none, word_counts(none))
    assert not np.array_equal(f[field.candidate], n)  # without the title rows the document scores change


def test_train_lexical_probe_with_a_title_mix_records_it(tmp_path, capsys):
    from rag_opt.cli import main
    from rag_opt.compressors.lexical_scorer import LexicalScorer
    from rag_opt.compressors.probe import Probe
    from tests.helpers import data_path

    data = data_path("hotpotqa", "train.jsonl.gz")
    out = tmp_path / "lexical.json"
    base = ["train-lexical-probe", "--data", str(data), "--out", str(out), "--limit", "40"]
    assert main([*base, "--title-mix", "field=0.5,none=0.3,text=0.2"]) == 0
    probe = Probe.load(out)
    assert probe.metadata["title_mix"] == {"field": 0.5, "none": 0.3, "text": 0.2}
    assert "40 questions" in probe.metadata["trained_on"]
    LexicalScorer(probe)  # a valid lexical probe
    assert main([*base, "--title-mix", "field=0.5"]) != 0
    assert "--title-mix: title mix shares must sum to 1" in capsys.readouterr().err
    # the mix changes what the probe learns from: the all-field probe differs
    assert main(base) == 0
    assert Probe.load(out).metadata["title_mix"] == {"field": 1.0}
    assert not np.allclose(Probe.load(out).weights, probe.weights)


@pytest.mark.model
def test_train_probe_reads_untitled_contexts_from_a_store_of_their_own(tmp_path):
    from rag_opt.cli import main
    from rag_opt.compressors.probe import Probe
    from rag_opt.models.loader import load_proxy_model
    from rag_opt.training.datasets import read_hotpotqa
    from rag_opt.training.sentence_probe import feature_store
    from tests.helpers import data_path

    data = data_path("hotpotqa", "train.jsonl.gz")
    out = tmp_path / "probe.json"
    args = ["train-probe", "--data", str(data), "--out", str(out), "--cache", str(tmp_path / "c"), "--limit", "4"]
    args += ["--encoding", "parallel", "--layers", "2", "--context", "named_by_other"]
    args += ["--blocks", "attn_last,attn_question,doc_attn_question,lexical"]  # no cross reading: plain stores
    assert main([*args, "--title-mix", "field=0.5,none=0.5"]) == 0
    proxy = load_proxy_model()
    titled = feature_store(tmp_path / "c", proxy, "train", 2, "parallel").load()
    untitled = feature_store(tmp_path / "c", proxy, "train-untitled", 2, "parallel").load()
    assert len(titled) == 2 and len(untitled) == 2 and not set(titled) & set(untitled)
    by_id = {ex.id: ex for ex in read_hotpotqa(data, seed=0, limit=4)}
    for i, f in untitled.items():  # one feature row per sentence: no title row was read
        assert f.unit.shape[0] == sum(len(s) for s in by_id[i].sentences)
    for i, f in titled.items():
        assert f.unit.shape[0] == sum(len(s) + 1 for s in by_id[i].sentences)
    probe = Probe.load(out)
    assert probe.metadata["title_mix"] == {"field": 0.5, "none": 0.5}
    assert "4 questions" in probe.metadata["trained_on"]
    # --cached-only finds both stores: nothing is extracted again
    shards = feature_store(tmp_path / "c", proxy, "train-untitled", 2, "parallel").target.shards()
    assert main([*args, "--title-mix", "field=0.5,none=0.5", "--cached-only"]) == 0
    assert feature_store(tmp_path / "c", proxy, "train-untitled", 2, "parallel").target.shards() == shards
