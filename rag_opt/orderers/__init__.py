"""Orderers: permutations of retrieved documents that place them where the LLM uses them best.

Every orderer returns a permutation ``perm`` of document indices: output slot ``i`` holds
input document ``perm[i]``.
"""

from rag_opt.orderers.lost_in_the_middle import LostInTheMiddle, end_placement, rank_scores

# Extend this list as orderers are added (e.g. AttentionSort, CalibratedPlacement).
__all__ = [
    "LostInTheMiddle",
    "end_placement",
    "rank_scores",
]
