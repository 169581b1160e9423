"""The library's own work limits and long-document handling (issue 52, A1 and A5), on the real embedded model:
default limits that a caller's scope overrides, an error that names the limit and how to lift it, the lexical
fallback when asked for, a block split that tokenizes each piece once and can be cancelled, and a progress line."""

from __future__ import annotations

import logging
import threading

import pytest

from rag_opt import ContextOptimizer, WorkLimits
from rag_opt.errors import Cancelled, RagOptError, WorkLimitExceeded
from rag_opt.work import DEFAULT_LIMITS, limits_given, progress_shown, scope
from tests.helpers import hotpot_dev

pytestmark = pytest.mark.model


def _long_document(paragraphs: int) -> str:
    parts = ["".join(sents) for ex in hotpot_dev(40) for _, sents in ex["context"]]
    return "\n\n".join(parts[:paragraphs])


def test_the_optimizer_has_default_limits_and_the_server_the_same():
    from rag_opt.server.settings import ProxySettings

    assert ContextOptimizer().limits == DEFAULT_LIMITS
    s = ProxySettings(upstream="http://127.0.0.1:9")
    assert (s.max_units, s.max_proxy_tokens, s.max_question_tokens) == (
        DEFAULT_LIMITS.max_units,
        DEFAULT_LIMITS.max_proxy_tokens,
        DEFAULT_LIMITS.max_question_tokens,
    )


def test_a_document_past_the_limit_raises_an_error_naming_the_limit_and_how_to_lift_it():
    ex = hotpot_dev(1)[0]
    opt = ContextOptimizer(ratio=0.3, limits=WorkLimits(max_proxy_tokens=300), cache=None)
    with pytest.raises(WorkLimitExceeded) as err:
        opt.optimize(ex["question"], [_long_document(6)])
    msg = str(err.value)
    assert isinstance(err.value, RagOptError)
    assert "more than the limit of 300" in msg and "limits=None" in msg and "tier='lexical'" in msg
    # lifted: the same document is read by the model tier
    lifted = ContextOptimizer(ratio=0.3, limits=None, cache=None).optimize(ex["question"], [_long_document(6)])
    assert lifted.tier == "model" and lifted.tokens_after < lifted.tokens_before


def test_past_the_limit_the_lexical_tier_answers_when_asked_and_says_so():
    ex = hotpot_dev(1)[0]
    opt = ContextOptimizer(ratio=0.3, limits=WorkLimits(max_proxy_tokens=300), over_limit="lexical", cache=None)
    result = opt.optimize(ex["question"], [_long_document(6)])
    assert result.tier == "lexical"
    assert any("more than the limit of 300" in w and "lexical tier" in w for w in result.warnings)
    assert 0 < result.tokens_after < result.tokens_before


def test_a_callers_scope_with_limits_takes_precedence_over_the_optimizers():
    ex = hotpot_dev(1)[0]
    opt = ContextOptimizer(ratio=0.3, limits=WorkLimits(max_proxy_tokens=300), cache=None)
    assert not limits_given()
    with scope(limits=WorkLimits(max_proxy_tokens=10**6)):
        assert limits_given()
        assert opt.optimize(ex["question"], [_long_document(6)]).tier == "model"
    with scope(limits=WorkLimits(max_proxy_tokens=100)), pytest.raises(WorkLimitExceeded) as err:
        opt.optimize(ex["question"], [_long_document(6)])
    assert "limits=None" not in str(err.value)  # the caller's limit: its own advice (e.g. the server's flag)


def test_bad_limit_options_are_refused():
    from rag_opt.errors import InvalidInputError, InvalidInputTypeError

    with pytest.raises(InvalidInputTypeError, match="limits must be"):
        ContextOptimizer(limits={"max_units": 3})  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="over_limit"):
        ContextOptimizer(over_limit="ignore")


class _CountingTokenizer:
    """The proxy's tokenizer, counting its calls (and the characters they read)."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.calls = 0
        self.chars = 0

    def __call__(self, text: str, **kw: object) -> object:
        self.calls += 1
        self.chars += len(text)
        return self.inner(text, **kw)  # type: ignore[operator]


def test_splitting_a_long_document_tokenizes_each_piece_once(proxy):
    from rag_opt.models.parallel import parallel_prompt

    units = [s for ex in hotpot_dev(30) for _, sents in ex["context"] for s in sents]
    tok = _CountingTokenizer(proxy.tokenizer)
    prompt = parallel_prompt(tok, [units], "What is it?", max_block_tokens=96)
    n_blocks = len(prompt.blocks)
    assert n_blocks > 20
    # the whole document once, each piece about once (a piece over the limit gives back a unit), the question and
    # the prefix: linear, where re-tokenizing each growing piece read every unit again per unit added
    assert tok.calls <= 2 * n_blocks + 4, (tok.calls, n_blocks)
    assert tok.chars <= 4 * sum(len(u) for u in units)
    seen = [u for b in prompt.blocks for u in dict.fromkeys(x for x in b.unit_of if x >= 0)]
    assert seen == list(range(len(units)))  # every unit, in order, in one block only
    assert all(len(b.ids) <= 96 for b in prompt.blocks)


def test_the_split_and_the_proxy_token_limit_come_before_any_model_work(proxy):
    from rag_opt.models.parallel import parallel_prompt

    units = [s for ex in hotpot_dev(30) for _, sents in ex["context"] for s in sents]
    cancel = threading.Event()
    cancel.set()
    with scope(cancel=cancel), pytest.raises(Cancelled):
        parallel_prompt(proxy.tokenizer, [units[:-1]], "What is it?", max_block_tokens=64)
    with scope(limits=WorkLimits(max_proxy_tokens=500)), pytest.raises(WorkLimitExceeded, match="limit of 500"):
        parallel_prompt(proxy.tokenizer, [units[:40], units[40:80], units[80:]], "What is it?", max_block_tokens=4096)


def test_reading_many_new_tokens_is_announced_and_a_servers_scope_turns_the_bar_off(proxy, monkeypatch, caplog):
    from rag_opt.models import document_pass
    from rag_opt.models.parallel import parallel_prompt

    monkeypatch.setattr(document_pass, "PROGRESS_TOKENS", 100)
    ex = hotpot_dev(1)[0]
    prompt = parallel_prompt(proxy.tokenizer, [list(s) for _, s in ex["context"][:3]], "q?", max_block_tokens=4096)
    with caplog.at_level(logging.INFO, logger="rag_opt.models.document_pass"):
        document_pass.encode_blocks(proxy, prompt.prefix, [b.ids for b in prompt.blocks], 2)
    assert any("new document tokens" in r.getMessage() for r in caplog.records)
    assert progress_shown()
    with scope(progress=False):
        assert not progress_shown()
        assert document_pass._progress(10**6) is None


def test_friction_messages_name_the_problem():
    """An unknown option names the closest known one; no documents at all says so (issue 54, item 6)."""
    import rag_opt
    from rag_opt.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"'rati' \(did you mean 'ratio'\?\)"):
        rag_opt.optimize("Which river?", ["The Rhine is a river."], rati=0.5)
    with pytest.raises(InvalidInputError, match="no documents were given"):
        rag_opt.optimize("Which river?", [])
