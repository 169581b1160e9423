"""The *order* stage's contract: the :class:`Orderer` protocol, its input and output values, and the registry.

An orderer takes the kept documents (their text as the LLM will read it and their relevance) and returns a
permutation: output slot ``i`` holds input document ``permutation[i]``. Orderers that need the proxy model or
the calibration profiles receive them when they are built (:meth:`Orderer.from_resources`), never by reaching
into another stage. Names are the :data:`rag_opt.types.OrderingName` literals; :func:`make_orderer` builds
one by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar, runtime_checkable

from rag_opt.types import ORDERING_NAMES, OrderingName, check_ordering

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.artifacts.position_profiles import ProfileStore
    from rag_opt.models.loader import ProxyModel
    from rag_opt.orderers.reader_profiles import ReaderProfileStore

__all__ = [
    "ORDERERS",
    "OrderItem",
    "Orderer",
    "OrdererResources",
    "Ordering",
    "make_orderer",
    "register_orderer",
]


@dataclass(frozen=True)
class OrderItem:
    """One kept document as an orderer sees it."""

    text: str  # the kept text as the LLM will read it (title line first, when the document has one)
    relevance: float  # higher is more relevant: rag-opt's score, else the retriever's, else minus the input rank


@dataclass
class Ordering:
    """An orderer's answer: the permutation and anything the caller should be told about it."""

    permutation: list[int]
    warnings: list[str] = field(default_factory=list)
    profile: str | None = None  # the profile that placed the documents (calibrated placement), in a few words


@dataclass
class OrdererResources:
    """What an orderer may need, handed over when it is built. ``proxy`` and ``profiles`` are called only by
    orderers that need them (loading the proxy model is not free); ``proxy`` raises a
    :class:`~rag_opt.errors.ConfigurationError` when no proxy model is available. ``reader``: the model that
    reads the context (None: unknown), and ``reader_profiles`` the store of readers' profiles."""

    proxy: Callable[[], ProxyModel]
    profiles: Callable[[], ProfileStore | None]
    max_tokens: int = 8192
    reader: str | None = None
    reader_profiles: Callable[[], ReaderProfileStore | None] = lambda: None


@runtime_checkable
class Orderer(Protocol):
    """Orders kept documents for the LLM."""

    name: ClassVar[str]
    reorders: ClassVar[bool]  # False only for the identity ordering (the pipeline then skips relevance scoring)

    @classmethod
    def from_resources(cls, resources: OrdererResources) -> Orderer: ...

    def order(self, query: str, documents: Sequence[OrderItem]) -> Ordering: ...


ORDERERS: dict[str, type[Orderer]] = {}
"""The registry: ordering name → orderer class (filled by :func:`register_orderer`)."""

_O = TypeVar("_O")


def register_orderer(cls: _O) -> _O:
    """Class decorator: register an orderer under its ``name`` (one of :data:`rag_opt.types.ORDERING_NAMES`)."""
    name = getattr(cls, "name", None)
    if name not in ORDERING_NAMES:
        raise ValueError(f"orderer name {name!r} is not an ordering name ({', '.join(ORDERING_NAMES)})")
    ORDERERS[name] = cls  # type: ignore[assignment]
    return cls


def make_orderer(name: OrderingName | str, resources: OrdererResources) -> Orderer:
    """Build the orderer registered as ``name`` (validated) with what it needs from ``resources``."""
    checked = check_ordering(name)
    _load_builtin()
    return ORDERERS[checked].from_resources(resources)


def _load_builtin() -> None:
    """Import the built-in orderers (they register themselves); cheap after the first call."""
    from rag_opt.orderers import attention_sort, calibrated, lost_in_the_middle, simple  # noqa: F401
