"""oneDNN-prepacked weights for the small matrix products of a question pass.

A question pass (:mod:`rag_opt.models.question_pass`) multiplies a few dozen tokens by every weight matrix of the
layers it reads. In bfloat16 on a CPU, ``torch.nn.functional.linear`` hands each product to oneDNN, which first
reorders the weight into its blocked layout, on every call; for ~25 rows that reordering costs as much as the
product. :func:`pack_linears` reorders each weight once (``torch.ops.mkldnn._reorder_linear_weight``, the same
prepacking ``torch.compile``'s freezing does) and routes products of at most :data:`PACKED_MAX_ROWS` rows through
the packed copy: the same oneDNN kernel on the same numbers, so the results are the same bit for bit (checked once
per model when it is packed; a model where they differ keeps ``F.linear``). Measured on the CI machine (one thread,
25 rows, bf16): 63 → 33 µs for a 576×576 weight, 159 → 95 µs for 576×1536; ``benchmarks/warm_path.py`` has the
effect on a warm request.

The packed copy costs the packed layers' weights a second time in memory (SmolLM2-135M's first 16 layers, the
question pass's depth: 113 MB in bf16; the process's RSS grew by 100 MiB when they were packed after a forward).
Larger products (a document pass) keep ``F.linear`` and the original weights. Only bfloat16 models on a CPU are
packed: oneDNN's float32 path does not give the same results packed.
"""

from __future__ import annotations

import logging
import types
from typing import TYPE_CHECKING, Any

from rag_opt.models.threads import available_cores

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rag_opt.models.loader import ProxyModel

__all__ = ["PACKED_MAX_ROWS", "pack_linears", "packed_layers"]

logger = logging.getLogger(__name__)

PACKED_MAX_ROWS = 64  # products of at most this many rows use the packed weight (a question pass has ~25)
_PACKED_ATTR = "_rag_opt_packed_weight"
_PACKED_LAYERS = "_rag_opt_packed_layers"  # on the model: how many of its first layers are packed (-1: cannot be)


def packed_layers(proxy: ProxyModel) -> int:
    """How many of the proxy's first decoder layers have packed weights (0: none; -1: this model cannot be)."""
    return int(getattr(proxy.model, _PACKED_LAYERS, 0))


def pack_linears(proxy: ProxyModel, depth: int) -> int:
    """Pack the linear layers of the proxy's first ``depth`` decoder layers (those not packed yet); returns how many
    layers are packed. A no-op off the CPU, for a model that is not bfloat16, for one whose decoder layers are not
    found, or where packing does not give the same results (then it is not tried again). The caller holds
    ``proxy.lock``."""
    import torch

    done = packed_layers(proxy)
    if done < 0 or done >= depth:
        return max(done, 0)
    layers = _decoder_layers(proxy.model)
    if (
        proxy.device != "cpu"
        or proxy.dtype != torch.bfloat16
        or proxy.precision != "bfloat16"
        or layers is None
        or not torch.backends.mkldnn.is_available()
        or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        setattr(proxy.model, _PACKED_LAYERS, -1)
        return 0
    linears = [m for layer in layers[done:depth] for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    try:
        packed = [_packed_weight(m.weight) for m in linears]
        shapes = {(m.in_features, m.out_features, m.bias is not None): i for i, m in enumerate(linears)}
        same = all(_same_results(linears[i], packed[i]) for i in shapes.values())  # one of each shape
    except RuntimeError as exc:  # an unusual build of torch or oneDNN
        logger.debug("not packing the proxy's linear layers: %s", exc)
        same = False
    if not same:
        logger.debug("not packing the proxy's linear layers: the packed product differs from F.linear here")
        setattr(proxy.model, _PACKED_LAYERS, -1)
        return 0
    for m, w in zip(linears, packed, strict=True):
        setattr(m, _PACKED_ATTR, w)
        m.forward = types.MethodType(_forward, m)  # type: ignore[method-assign]  # this module only, not its class
    n = min(depth, len(layers))
    setattr(proxy.model, _PACKED_LAYERS, n)
    return n


def _decoder_layers(model: Any) -> Any:
    base = getattr(model, "model", None) or getattr(model, "base_model", None)
    layers = getattr(base, "layers", None)
    return layers if layers is not None and hasattr(layers, "__getitem__") else None


def _packed_weight(weight: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)


def _same_results(linear: torch.nn.Linear, packed: torch.Tensor) -> bool:
    """Whether the packed weight gives ``F.linear``'s results exactly, for a few row counts."""
    import torch

    gen = torch.Generator().manual_seed(0)
    was = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for rows in sorted({1, 7, 25, PACKED_MAX_ROWS}):
                x = torch.randn((rows, linear.in_features), generator=gen).to(torch.bfloat16)
                torch.set_num_threads(1)
                want = torch.nn.functional.linear(x, linear.weight, linear.bias)
                for n in sorted({1, available_cores()}):
                    torch.set_num_threads(n)
                    got = torch.ops.mkldnn._linear_pointwise(x, packed, linear.bias, "none", [], "")
                    if not torch.equal(want, got):
                        return False
    finally:
        torch.set_num_threads(was)
    return True


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    import torch

    if x.dtype == torch.bfloat16 and not x.requires_grad and x.numel() <= PACKED_MAX_ROWS * x.shape[-1]:
        return torch.ops.mkldnn._linear_pointwise(x, getattr(self, _PACKED_ATTR), self.bias, "none", [], "")
    return torch.nn.functional.linear(x, self.weight, self.bias)
