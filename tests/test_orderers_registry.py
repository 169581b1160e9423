"""The Orderer protocol and its registry: one name per ordering, validated in one place."""

from __future__ import annotations

import pytest

from rag_opt.errors import ConfigurationError, InvalidInputError, RagOptError
from rag_opt.orderers import ORDERERS, Orderer, OrdererResources, OrderItem, make_orderer
from rag_opt.types import ORDERING_NAMES, Budget


def _resources() -> OrdererResources:
    def no_proxy():
        raise ConfigurationError("no proxy model here")

    return OrdererResources(proxy=no_proxy, profiles=lambda: None)


def test_every_ordering_name_has_exactly_one_registered_orderer() -> None:
    make_orderer("input", _resources())  # loads the built-in orderers
    assert sorted(ORDERERS) == sorted(ORDERING_NAMES)
    for name, cls in ORDERERS.items():
        assert cls.name == name and isinstance(cls.reorders, bool)


def test_model_free_orderers_follow_the_protocol() -> None:
    items = [OrderItem(f"doc {i}", r) for i, r in enumerate([0.2, 0.9, 0.5, 0.1])]
    names = ("input", "relevance", "lost_in_the_middle", "promote_best", "promote_clear_best")
    got = {n: make_orderer(n, _resources()) for n in names}
    assert all(isinstance(o, Orderer) for o in got.values())
    assert got["input"].order("q", items).permutation == [0, 1, 2, 3]
    assert got["relevance"].order("q", items).permutation == [1, 2, 0, 3]
    assert got["lost_in_the_middle"].order("q", items).permutation == [1, 0, 3, 2]
    assert got["promote_best"].order("q", items).permutation == [1, 0, 2, 3]
    assert got["promote_clear_best"].order("q", items).permutation == [0, 1, 2, 3]  # 0.2 > 1/20 of 0.9


def test_promote_best_moves_only_the_best_document() -> None:
    promote = make_orderer("promote_best", _resources())

    def perm(relevance: list[float]) -> list[int]:
        return promote.order("q", [OrderItem(f"doc {i}", r) for i, r in enumerate(relevance)]).permutation

    assert perm([0.9, 0.1, 0.5, 0.7]) == [0, 1, 2, 3]  # already first: the context is left as it came
    assert perm([0.1, 0.5, 0.3, 0.2, 0.9]) == [4, 0, 1, 2, 3]  # the others keep their input order
    assert perm([0.3, 0.8, 0.2, 0.8]) == [1, 0, 2, 3]  # a tie promotes the earlier document
    assert perm([0.4]) == [0] and perm([]) == []
    with pytest.raises(InvalidInputError, match=r"scores\[1\] must be finite"):
        perm([0.4, float("nan"), 0.2])


def test_relevance_order_sorts_ties_in_input_order_and_refuses_non_finite_relevance() -> None:
    by_relevance = make_orderer("relevance", _resources())

    def perm(relevance: list[float]) -> list[int]:
        return by_relevance.order("q", [OrderItem(f"doc {i}", r) for i, r in enumerate(relevance)]).permutation

    assert perm([0.3, 0.8, 0.3, 0.9]) == [3, 1, 0, 2]
    assert perm([-2.0, 5, -1.5]) == [1, 2, 0] and perm([]) == []
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(InvalidInputError, match=r"scores\[1\] must be finite"):
            perm([0.4, bad, 0.2])


def test_promote_clear_best_moves_the_best_document_only_when_the_first_is_far_below_it() -> None:
    from rag_opt.orderers import PromoteClearBest
    from rag_opt.orderers.simple import CLEAR_BEST_SHARE

    clear = make_orderer("promote_clear_best", _resources())
    assert isinstance(clear, PromoteClearBest) and clear.share == CLEAR_BEST_SHARE == 0.05

    def perm(relevance: list[float], share: float = 0.2) -> list[int]:
        items = [OrderItem(f"doc {i}", r) for i, r in enumerate(relevance)]
        return PromoteClearBest(share).order("q", items).permutation

    assert perm([0.1, 0.5, 0.3, 0.9]) == [3, 0, 1, 2]  # 0.1 <= 0.2 * 0.9: promoted, the others in input order
    assert perm([0.2, 0.5, 0.3, 0.9]) == [0, 1, 2, 3]  # 0.2 > 0.18: the first is close enough, left as it came
    assert make_orderer("promote_clear_best", _resources()).order(
        "q", [OrderItem("a", 0.04), OrderItem("b", 0.9)]
    ).permutation == [1, 0]  # the default share: 0.04 <= 0.045
    assert perm([0.18, 0.9]) == [1, 0]  # exactly the share: promoted
    assert perm([0.9, 0.1, 0.95], share=1.0) == [2, 0, 1]  # share 1 is promote_best
    assert perm([0.0, 0.0]) == [0, 1] and perm([0.7]) == [0] and perm([]) == []
    # below zero, measured from the lowest score: -9 is at 0.1 of the way from -10 to 0 (the best)
    assert perm([-9.0, 0.0, -10.0]) == [1, 0, 2]
    assert perm([-5.0, 0.0, -10.0]) == [0, 1, 2]
    with pytest.raises(InvalidInputError, match=r"scores\[2\] must be finite"):
        perm([0.4, 0.1, float("inf")])
    for bad in (-0.1, 1.5, True, "0.2"):
        with pytest.raises(InvalidInputError, match="share must be a number in"):
            PromoteClearBest(bad)  # type: ignore[arg-type]


def test_orderers_that_need_the_proxy_model_say_so_when_it_is_missing() -> None:
    for name in ("attention_sort", "calibrated"):
        with pytest.raises(ConfigurationError, match="no proxy model"):
            make_orderer(name, _resources())


def test_unknown_names_and_bad_budgets_are_one_error_family() -> None:
    with pytest.raises(InvalidInputError, match="unknown ordering 'best'"):
        make_orderer("best", _resources())
    with pytest.raises(RagOptError, match="at most one of ratio, target_tokens and threshold"):
        Budget(ratio=0.5, target_tokens=10)
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\]"):
        Budget(ratio=1.5)
    assert Budget(ratio=0.25).tokens(101) == 25 and Budget(target_tokens=7).tokens(1000) == 7
    assert not Budget().compresses and Budget(threshold=0.4).tokens(50) is None
