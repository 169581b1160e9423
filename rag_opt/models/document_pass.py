"""Document passes of parallel encoding: ``prefix + block`` through the proxy, keeping each layer's key/value states.

A block's states depend on nothing but the shared prefix and its own tokens (:mod:`rag_opt.models.parallel`),
so blocks of any contexts can share a forward pass: they are sorted by length and right-padded into batches of
at most ``batch_tokens`` tokens and of about one length (causal attention: no real token reads the padding after
it, and SDPA keeps its fast causal path). The forward pass stops after the last layer needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rag_opt.models.capture import Capture, StopForward, capturing
from rag_opt.work import checkpoint

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rag_opt.models.loader import ProxyModel

__all__ = ["encode_blocks"]


def encode_blocks(
    proxy: ProxyModel,
    prefix: Sequence[int],
    blocks: Sequence[Sequence[int]],
    depth: int,
    *,
    batch_tokens: int = 6144,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Key/value states of the first ``depth`` layers for every block: ``(prefix_states, [block_states])``, each
    a tensor ``(2, depth, kv_heads, tokens, head_dim)`` (keys then values, rotary embeddings applied) in the
    model's dtype, on the CPU. The prefix's states are the same in every pass (they read only the prefix)."""
    if not blocks:
        raise ValueError("no blocks to encode")
    order = sorted(range(len(blocks)), key=lambda i: len(blocks[i]))
    out: list[torch.Tensor | None] = [None] * len(blocks)
    prefix_states: torch.Tensor | None = None
    batch: list[int] = []
    p = len(prefix)
    for i in [*order, -1]:
        width = p + len(blocks[i]) if i >= 0 else 0
        # a batch holds blocks of about one length: on a CPU a forward pass costs about the same per token at any
        # batch size, so padding is pure waste (sorted by length, a new batch starts past 1.2x the shortest)
        if batch and (
            i < 0 or width * (len(batch) + 1) > batch_tokens or width > 1.2 * (p + len(blocks[batch[0]])) + 8
        ):
            checkpoint()  # between forward passes: stop here if the caller gave up (rag_opt.work)
            pre, states = _run(proxy, prefix, [blocks[j] for j in batch], depth)
            prefix_states = pre if prefix_states is None else prefix_states
            for j, s in zip(batch, states, strict=True):
                out[j] = s
            batch = []
        if i >= 0:
            batch.append(i)
    assert prefix_states is not None and all(s is not None for s in out)
    return prefix_states, [s for s in out if s is not None]


def _run(
    proxy: ProxyModel, prefix: Sequence[int], blocks: Sequence[Sequence[int]], depth: int
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    import torch

    dev = proxy.device
    p = len(prefix)
    width = p + max(len(b) for b in blocks)
    pad = proxy.tokenizer.pad_token_id
    pad = pad if pad is not None else proxy.tokenizer.eos_token_id or 0
    ids = torch.tensor([[*prefix, *b] + [pad] * (width - p - len(b)) for b in blocks], device=dev)
    capture = Capture(items=[], stop_after=depth - 1 if depth < proxy.num_layers else None, keep_kv=True)
    base = getattr(proxy.model, "model", None) or proxy.model.base_model
    with capturing(capture), proxy.lock, torch.inference_mode():
        if dev == "cpu":
            proxy.threads.apply()
        try:
            base(input_ids=ids, use_cache=False)
        except StopForward:
            pass
        if len(capture.kv) < depth:
            raise RuntimeError(
                f"captured key/value states from {len(capture.kv)} of {depth} layers: the proxy model's attention "
                "does not dispatch through transformers' AttentionInterface"
            )
        keys = torch.stack([capture.kv[layer][0] for layer in range(depth)], dim=1)  # (B, L, KVH, T, d)
        values = torch.stack([capture.kv[layer][1] for layer in range(depth)], dim=1)
        both = torch.stack([keys, values], dim=1).cpu()  # (B, 2, L, KVH, T, d)
    prefix_states = both[0, :, :, :, :p].clone()
    return prefix_states, [both[b, :, :, :, p : p + len(blk)].clone() for b, blk in enumerate(blocks)]
