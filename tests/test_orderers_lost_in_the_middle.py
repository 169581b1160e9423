"""Tests for the lost-in-the-middle end placement orderer."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rag_opt.orderers import LostInTheMiddle, OrderItem, end_placement, rank_scores


def _order(orderer: LostInTheMiddle, scores: Sequence[float]) -> list[int]:
    """The orderer's permutation for documents with these relevance scores."""
    return orderer.order("question", [OrderItem(f"doc {i}", s) for i, s in enumerate(scores)]).permutation


# Expected permutations for scores that decrease with the input index (input index == rank).
# Rule, best="first": rank k goes to slot k // 2 for even k and N - 1 - k // 2 for odd k.
EXPECTED_FIRST: dict[int, list[int]] = {
    1: [0],
    2: [0, 1],
    3: [0, 2, 1],
    4: [0, 2, 3, 1],
    5: [0, 2, 4, 3, 1],
    6: [0, 2, 4, 5, 3, 1],
    7: [0, 2, 4, 6, 5, 3, 1],
    8: [0, 2, 4, 6, 7, 5, 3, 1],
}
EXPECTED_LAST: dict[int, list[int]] = {
    1: [0],
    2: [1, 0],
    3: [1, 2, 0],
    4: [1, 3, 2, 0],
    5: [1, 3, 4, 2, 0],
    6: [1, 3, 5, 4, 2, 0],
    7: [1, 3, 5, 6, 4, 2, 0],
    8: [1, 3, 5, 7, 6, 4, 2, 0],
}


# --- exact permutations -------------------------------------------------------------------


@pytest.mark.parametrize("n", sorted(EXPECTED_FIRST))
def test_exact_best_first(n: int) -> None:
    scores = [float(n - i) for i in range(n)]  # e.g. N=4 -> [4, 3, 2, 1]
    assert end_placement(scores) == EXPECTED_FIRST[n]
    assert end_placement(scores, best="first") == EXPECTED_FIRST[n]
    assert _order(LostInTheMiddle(), scores) == EXPECTED_FIRST[n]
    assert _order(LostInTheMiddle(best="first"), scores) == EXPECTED_FIRST[n]


@pytest.mark.parametrize("n", sorted(EXPECTED_LAST))
def test_exact_best_last(n: int) -> None:
    scores = [float(n - i) for i in range(n)]
    assert end_placement(scores, best="last") == EXPECTED_LAST[n]
    assert _order(LostInTheMiddle(best="last"), scores) == EXPECTED_LAST[n]


@pytest.mark.parametrize("n", sorted(EXPECTED_FIRST))
def test_rank_scores_gives_input_order_ranking(n: int) -> None:
    assert rank_scores(n) == [-float(i) for i in range(n)]
    assert end_placement(rank_scores(n)) == EXPECTED_FIRST[n]
    assert end_placement(rank_scores(n), best="last") == EXPECTED_LAST[n]


def test_examples_from_spec() -> None:
    assert end_placement([4, 3, 2, 1]) == [0, 2, 3, 1]
    assert end_placement([5, 4, 3, 2, 1]) == [0, 2, 4, 3, 1]


@pytest.mark.parametrize("n", [2, 4, 6, 8, 3, 5, 7])
def test_best_end_does_not_depend_on_parity(n: int) -> None:
    # LangChain's LongContextReorder puts the best document last for even N; we never do.
    scores = rank_scores(n)
    assert end_placement(scores, best="first")[0] == 0
    assert end_placement(scores, best="last")[-1] == 0


def test_empty_and_single() -> None:
    assert end_placement([]) == []
    assert end_placement([], best="last") == []
    assert end_placement([0.3]) == [0]
    assert end_placement([0.3], best="last") == [0]
    assert _order(LostInTheMiddle(), []) == []
    assert rank_scores(0) == []


# --- shuffled scores ----------------------------------------------------------------------


def test_shuffled_scores_n4() -> None:
    scores = [0.1, 0.9, 0.5, 0.7]  # ranking by index: 1, 3, 2, 0
    assert end_placement(scores) == [1, 2, 0, 3]
    assert end_placement(scores, best="last") == [3, 0, 2, 1]


def test_shuffled_scores_n5() -> None:
    scores = [2, 5, 1, 4, 3]  # ranking by index: 1, 3, 4, 0, 2
    assert end_placement(scores) == [1, 4, 2, 0, 3]
    assert end_placement(scores, best="last") == [3, 0, 2, 4, 1]


def test_negative_scores() -> None:
    scores = [-3.0, -1.0, -2.0]  # ranking by index: 1, 2, 0
    assert end_placement(scores) == [1, 0, 2]
    assert end_placement(scores, best="last") == [2, 0, 1]


def test_does_not_mutate_input_and_accepts_tuple() -> None:
    scores = [0.1, 0.9, 0.5, 0.7]
    before = list(scores)
    end_placement(scores)
    assert scores == before
    assert end_placement(tuple(scores)) == [1, 2, 0, 3]


def test_accepts_numpy_scalars() -> None:
    np = pytest.importorskip("numpy")
    scores = np.array([0.1, 0.9, 0.5, 0.7])
    assert end_placement(list(scores)) == [1, 2, 0, 3]
    assert end_placement(scores) == [1, 2, 0, 3]


# --- ties ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", sorted(EXPECTED_FIRST))
def test_all_equal_scores_fall_back_to_input_order(n: int) -> None:
    scores = [0.5] * n
    assert end_placement(scores) == EXPECTED_FIRST[n]
    assert end_placement(scores, best="last") == EXPECTED_LAST[n]


def test_partial_ties_are_stable() -> None:
    scores = [1, 3, 3, 1, 2]  # ranking by index: 1, 2 (tie), 4, 0, 3 (tie)
    assert end_placement(scores) == [1, 4, 3, 0, 2]
    assert end_placement(scores, best="last") == [2, 0, 3, 4, 1]


def test_signed_zero_is_a_tie() -> None:
    assert end_placement([-0.0, 0.0]) == [0, 1]
    assert end_placement([0.0, -0.0]) == [0, 1]


def test_int_and_float_ties() -> None:
    assert end_placement([1.0, 2, 2.0, 1]) == [1, 0, 3, 2]


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_score_names_index(bad: float) -> None:
    with pytest.raises(ValueError, match=r"scores\[2\] must be finite"):
        end_placement([0.1, 0.2, bad, 0.3])
    with pytest.raises(ValueError, match=r"scores\[0\]"):
        _order(LostInTheMiddle(), [bad])


def test_non_numeric_score_raises_type_error() -> None:
    with pytest.raises(TypeError, match=r"scores\[1\] must be a real number"):
        end_placement([0.1, "0.2"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"scores\[0\]"):
        end_placement([None])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"scores\[0\]"):
        end_placement([True, False])
    with pytest.raises(TypeError, match="sequence of numbers"):
        end_placement("abc")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["middle", "First", "", None, 0])
def test_invalid_best_raises(bad: object) -> None:
    with pytest.raises(ValueError, match="best must be 'first' or 'last'"):
        end_placement([1.0, 2.0], best=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="best must be 'first' or 'last'"):
        LostInTheMiddle(best=bad)  # type: ignore[arg-type]


def test_invalid_best_raises_even_for_empty_scores() -> None:
    with pytest.raises(ValueError, match="best"):
        end_placement([], best="middle")  # type: ignore[arg-type]


def test_rank_scores_validation() -> None:
    with pytest.raises(ValueError, match="n must be >= 0"):
        rank_scores(-1)
    with pytest.raises(TypeError, match="n must be an int"):
        rank_scores(2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="n must be an int"):
        rank_scores(True)


def test_repr() -> None:
    assert repr(LostInTheMiddle(best="last")) == "LostInTheMiddle(best='last')"


# --- properties ---------------------------------------------------------------------------

finite_scores = st.lists(
    st.one_of(
        st.floats(allow_nan=False, allow_infinity=False),
        st.integers(min_value=-(10**6), max_value=10**6),
        st.sampled_from([0.0, 0.5, 1.0]),  # many ties
    ),
    max_size=40,
)


def _reference(scores: Sequence[float], best: str) -> list[int]:
    """Independent formulation: fill from both ends with two stacks."""
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    left = ranked[0::2]
    right = ranked[1::2]
    first = left + right[::-1]
    return first if best == "first" else first[::-1]


@given(scores=finite_scores, best=st.sampled_from(["first", "last"]))
def test_property_end_placement(scores: list[float], best: str) -> None:
    perm = end_placement(scores, best=best)  # type: ignore[arg-type]
    n = len(scores)

    # A permutation of the input indices.
    assert sorted(perm) == list(range(n))
    assert perm == _reference(scores, best)
    assert _order(LostInTheMiddle(best=best), scores) == perm  # type: ignore[arg-type]
    if n == 0:
        return

    ranked = sorted(range(n), key=lambda i: (-scores[i], i))
    best_end, other_end = (0, n - 1) if best == "first" else (n - 1, 0)
    # The best document is at the chosen end, the 2nd best at the other end.
    assert perm[best_end] == ranked[0]
    if n >= 2:
        assert perm[other_end] == ranked[1]

    # Scores never increase from either end toward the worst document in the middle.
    vals = [scores[i] for i in perm]
    m = perm.index(ranked[-1])
    assert all(vals[i] >= vals[i + 1] for i in range(m))
    assert all(vals[i] <= vals[i + 1] for i in range(m, n - 1))


@given(scores=finite_scores)
def test_property_last_mirrors_first(scores: list[float]) -> None:
    assert end_placement(scores, best="last") == end_placement(scores, best="first")[::-1]


@given(n=st.integers(min_value=0, max_value=60))
def test_property_rank_scores_matches_input_order(n: int) -> None:
    perm = end_placement(rank_scores(n))
    left = list(range(0, n, 2))
    right = list(range(1, n, 2))
    assert perm == left + right[::-1]
