"""Orderers: permutations of retrieved documents that place them where the LLM uses them best.

Every orderer returns a permutation ``perm`` of document indices: output slot ``i`` holds
input document ``perm[i]``.
"""

from rag_opt.orderers.attention_sort import AttentionSort
from rag_opt.orderers.calibrated import CalibratedPlacement, placement, resample_slots, slot_attention_for
from rag_opt.orderers.lost_in_the_middle import LostInTheMiddle, end_placement, rank_scores

__all__ = [
    "AttentionSort",
    "CalibratedPlacement",
    "LostInTheMiddle",
    "end_placement",
    "placement",
    "rank_scores",
    "resample_slots",
    "slot_attention_for",
]
