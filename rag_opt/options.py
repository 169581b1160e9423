"""The optimizer's options, declared once: :class:`OptimizerOptions`.

Each option is one field of :class:`OptimizerOptions`: its type, its default, a one-line help (:func:`option`) and
its documentation (the docstring under it). Every surface derives from that declaration:

- :class:`~rag_opt.ContextOptimizer` takes an :class:`OptimizerOptions` and any option by name over it
  (:func:`~rag_opt.option_args.resolve_options`), its signature typed from the fields
  (:func:`~rag_opt.option_args.options_signature`);
- the command line's flags (:mod:`rag_opt.cli.option_flags`) and ``rag-opt serve``'s settings, flags and
  ``RAG_OPT_*`` variables (:mod:`rag_opt.server.option_settings`) are generated from the fields and their
  :class:`TextForm`;
- :func:`rag_opt.optimize`, the adapters (LangChain, LlamaIndex, Haystack, LiteLLM), the gateway and batch take
  exactly these names, an unknown one refused naming the closest (:func:`~rag_opt.option_args.check_option_names`).

Adding an option is one field here and its docstring; ``tests/test_options.py`` adds one to this file alone and
finds it on every surface, and ``tests/test_architecture.py`` checks that no other module lists the options by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rag_opt.inputs import check_budget, check_tier
from rag_opt.models.prompt import DEFAULT_ENCODING, ENCODINGS
from rag_opt.option_checks import (
    OVER_LIMIT,
    OverLimit,
    check_drop_below_best,
    check_encoding,
    check_limits,
    check_over_limit,
    check_reader,
    check_target,
    check_threads,
    check_title_from_text,
    check_window,
    key_list,
    none_or,
    thread_count,
)
from rag_opt.text.language import check_language
from rag_opt.text.titles import DEFAULT_TITLE_KEYS, check_title_keys
from rag_opt.types import DEFAULT_ORDERING, DEFAULT_RATIO, ORDERING_NAMES, TIERS, Budget, check_ordering
from rag_opt.work import DEFAULT_LIMITS, WorkLimits

if TYPE_CHECKING:  # pragma: no cover
    from rag_opt.compressors.base import Scorer
    from rag_opt.models.encoding_cache import EncodingCache
    from rag_opt.models.threads import ThreadPolicy
    from rag_opt.types import OrderingName, Tier

__all__ = [
    "BUDGET_FIELDS",
    "DTYPES",
    "OVER_LIMIT",
    "OptimizerOptions",
    "OptionSpec",
    "OverLimit",
    "TextForm",
    "option",
    "option_names",
    "option_spec",
    "options_in_group",
]

DTYPES = ("float32", "bfloat16", "float16", "int8")
#: the budget's three spellings, as :class:`~rag_opt.types.Budget` has them (at most one is given)
BUDGET_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Budget))
_KEY = "rag_opt.option"


@dataclass(frozen=True)
class TextForm:
    """How an option is written as text: a command-line flag, a ``rag-opt serve`` setting and its ``RAG_OPT_*``
    variable.

    ``kind`` is what the text is read as (``str``, ``int``, ``float`` or ``bool``), ``parse`` turns what was read
    into the option's value (``'none'`` into None, ``'a,b'`` into a tuple), ``choices`` and ``bounds`` (``gt``,
    ``ge``, ``lt``, ``le``) restrict it, ``flag`` is a flag of its own (default ``--name``, or ``--no-name`` for a
    boolean that is on by default), ``setting`` a ``rag-opt serve`` setting name of its own (its variable follows
    it), ``shown`` the default as help shows it. ``cli`` / ``server``: False where that surface sets the option its
    own way (the reason in a comment beside it).
    """

    kind: type
    parse: Callable[[Any], Any] | None = None
    choices: tuple[str, ...] = ()
    bounds: Mapping[str, float] = field(default_factory=dict)
    metavar: str | None = None
    flag: str | None = None
    setting: str | None = None
    shown: str | None = None
    cli: bool = True
    server: bool = True


@dataclass(frozen=True)
class OptionSpec:
    """What :func:`option` declares beside a field's type and default: its one-line ``help`` (the command line's
    and the server's), its ``check`` (validates a value and returns it, normalized; raises
    :class:`~rag_opt.errors.InvalidInputError`), its :class:`TextForm` (``"infer"``: from the field's type when
    that is ``bool``, ``int``, ``float`` or ``str``, optional or not; None: none, the option is an object) and its
    ``group`` (options some commands take together: ``budget``, ``proxy``, ``titles``)."""

    help: str
    check: Callable[[Any], Any] | None = None
    text: TextForm | Literal["infer"] | None = "infer"
    group: str | None = None


def option(
    default: Any,
    help: str,
    *,
    check: Callable[[Any], Any] | None = None,
    text: TextForm | Literal["infer"] | None = "infer",
    group: str | None = None,
) -> Any:
    """One option of :class:`OptimizerOptions`: its default and :class:`OptionSpec`."""
    return field(default=default, metadata={_KEY: OptionSpec(help, check, text, group)})


@dataclass(frozen=True, kw_only=True)
class OptimizerOptions:
    """Every option of a :class:`~rag_opt.ContextOptimizer`, with its default: one declaration that the library,
    the command line, ``rag-opt serve``, the adapters, the gateway and batch all derive from (see
    :mod:`rag_opt.options`).

    ``ContextOptimizer(ratio=0.3, keep_best_per_doc=True)`` is ``ContextOptimizer(OptimizerOptions(ratio=0.3,
    keep_best_per_doc=True))``; an options object is reusable, and ``ContextOptimizer(options, tier="lexical")``
    takes it with an option replaced. Built, it is valid: each option is checked (and normalized: ``title_keys`` a
    tuple, ``language`` its canonical code) as the optimizer checks it, raising
    :class:`~rag_opt.errors.InvalidInputError` (or :class:`~rag_opt.errors.InvalidInputTypeError`) naming it.
    """

    model: str | None = option(
        None,
        "proxy model: Hugging Face id, local folder or .gguf (default: the embedded SmolLM2)",
        text=TextForm(str, setting="proxy_model", metavar="MODEL"),
        group="proxy",
    )
    """The proxy model (None: the embedded default SmolLM2-135M; a Hugging Face id, a local folder or a .gguf).
    ``rag-opt serve`` calls this setting ``proxy_model`` (``--model``, ``RAG_OPT_PROXY_MODEL``, the variable the
    library reads for its default proxy model)."""

    target: str | None = option(
        None,
        "tokenizer of the target LLM, budgets are in its tokens: OpenAI model or tiktoken encoding name, or hf:<id>",
        check=check_target,
    )
    """The target LLM whose tokens budgets are measured in (tiktoken model/encoding name, or ``hf:<tokenizer>``);
    default ``o200k_base``. An unknown name is an error (never a silent fallback)."""

    ratio: float | None = option(
        None,
        f"fraction of target-LLM tokens to keep, in (0, 1] (default {DEFAULT_RATIO} when no budget is given; 1 keeps "
        "everything)",
        text=TextForm(float, bounds={"gt": 0, "le": 1}),
        group="budget",
    )
    """The default budget as a fraction of the context's target tokens, in (0, 1]. At most one of ``ratio``,
    ``target_tokens``, ``threshold`` and ``budget``; none given: ``ratio=`` :data:`~rag_opt.types.DEFAULT_RATIO`
    (0.5), the default of every surface; ``ratio=1`` keeps everything. When a result is not compressed (its budget
    holds the whole context), its ``warnings`` say so."""

    target_tokens: int | None = option(
        None,
        "token budget in the target LLM's tokens",
        text=TextForm(int, bounds={"ge": 0}),
        group="budget",
    )
    """The default budget as a number of target tokens."""

    threshold: float | None = option(
        None,
        "keep sentences whose relevance probability is >= this",
        text=TextForm(float, bounds={"ge": 0, "le": 1}),
        group="budget",
    )
    """The default budget as a relevance probability: keep the sentences scoring at least this."""

    budget: Budget | None = option(
        None, "the default budget as a rag_opt.Budget", text=None, group="budget"
    )  # an object: the command line and the server take its three fields
    """The default budget as a :class:`~rag_opt.types.Budget`."""

    ordering: OrderingName | str = option(
        DEFAULT_ORDERING,
        "document ordering (docs/reordering.md)",
        check=check_ordering,
        text=TextForm(str, choices=ORDERING_NAMES),
    )
    """``promote_clear_best`` (the default, chosen by ``benchmarks/litm.py``, docs/reordering.md: the best document
    moves to the front only when the first document's relevance is at most 1/20 of the best's, the rest keep their
    input order), ``lost_in_the_middle`` (end placement: the best document first, the second best last, and so on
    toward the middle), ``relevance`` (best first, the rest by descending relevance), ``promote_best`` (the best
    document first, the rest in input order), ``input`` (keep), ``calibrated`` (best into the slots the proxy
    attends to most, from its calibration profile) or ``attention_sort`` (the proxy's attention sorts the kept
    documents, 2 rounds: extra forward passes). Document relevance is position-calibrated when a profile exists
    (``result.calibrated``)."""

    probe: str | None = option(
        "auto",
        "the sentence probe: 'auto' (shipped for the model), a probe JSON path, or 'none' (raw attention)",
        text=TextForm(str, parse=none_or, metavar="PROBE"),
    )
    """``"auto"`` (the probe shipped for the model), a path to a probe JSON, or None (raw attention)."""

    keep_best_per_doc: bool = option(
        False, "keep at least the best sentence of every document (while the budget allows)"
    )
    """Keep at least the best sentence of every document (while the budget allows)."""

    keep_first: bool = option(False, "always keep each document's first sentence (while the budget allows)")
    """Always keep each document's first sentence (while the budget allows)."""

    keep_antecedents: bool = option(
        True,
        "keep a sentence that leans on the one before it (opening with It, She, These, ...; 'than that', 'this "
        "method', 'The treatment ...') only together with the sentence before it",
        text=TextForm(bool, flag="--no-antecedents"),
    )
    """Keep an English sentence that leans on the one before it — opening with a pronoun (``It``, ``She``,
    ``These``, ...), or a demonstrative or definite back-reference ("than that", "this method", "The treatment ..."
    whose noun the sentence before introduced: :mod:`rag_opt.text.references`) — only together with the sentence
    before it, so no kept sentence dangles (default on)."""

    drop_below_best: float | None = option(
        None,
        "under a budget, drop the documents whose relevance is below this share of the best one's (0.05 suits "
        "single-answer questions; off by default: it drops the bridge documents of multi-hop ones)",
        check=check_drop_below_best,
        text=TextForm(float, metavar="SHARE"),
    )
    """With a budget, drop the documents whose relevance is below this share of the best document's, in (0, 1] (a
    ``required`` one stays, and one a document above the bar names: a possible second hop; ``result.warnings``
    names them). 0.05 suits single-answer questions; default None: it costs multi-hop questions facts
    (docs/reordering.md)."""

    device: str | None = option(
        None, "where the proxy model runs: cuda, cpu, ... (default: cuda when available)", group="proxy"
    )
    """Where the proxy runs (default cuda when available)."""

    dtype: str | None = option(
        None,
        "proxy model dtype (default: bfloat16 where the hardware has it, else float32; int8 needs torchao)",
        text=TextForm(str, choices=DTYPES),
        group="proxy",
    )
    """How the proxy runs (default bfloat16 on GPUs and on CPUs with native bf16 instructions, float32 on other
    CPUs; ``"int8"`` with torchao)."""

    max_window_tokens: int = option(
        8192,
        "proxy tokens per forward pass; longer contexts are read in windows",
        check=check_window,
        text=TextForm(int, metavar="TOKENS"),
    )
    """Proxy tokens per forward pass (at least 128); longer contexts are processed in windows (and their document
    relevance is not calibrated)."""

    trust_remote_code: bool = option(False, "let transformers run a hub proxy model's own code")
    """Passed to transformers for hub models (off by default)."""

    language: str = option(
        "en",
        "ISO 639 code of the documents' language (en, de, fr, pt-BR, ...): sentence segmentation and BM25 stopwords "
        "follow it (the shipped probes were trained on English)",
        check=check_language,
    )
    """ISO 639 code of the documents' language (``en``, ``de``, ``pt-BR``, ...): sentence segmentation and BM25
    stopwords follow it (see :mod:`rag_opt.text.language`). The shipped probes were trained on English: a result
    scored by one for another language says so in its ``warnings``."""

    scorer: Scorer | None = option(None, "score units with this instead of the Sentinel probe", text=None)
    """Score units with this instead of the Sentinel probe (e.g. ``rag_opt.compressors.BM25Scorer()``); an object,
    so not on the command line or the server."""

    doc_probe: str | None = option(
        "auto",
        "the document relevance probe: 'auto' (shipped for the model), a probe JSON path, or 'none' (a document's "
        "relevance is its best sentence's)",
        text=TextForm(str, parse=none_or, metavar="PROBE"),
    )
    """The document relevance probe: ``"auto"`` (shipped for the model), a path, or None (document relevance = its
    best sentence's score)."""

    calibrate: bool = option(True, "position-calibrate document relevance when a calibration profile exists")
    """Position-calibrate document relevance when a calibration profile exists for the number of documents (shipped
    for the embedded model at 10, 20 and 30; ``rag-opt calibrate`` adds others)."""

    tier: Tier | str = option(
        "model",
        "model: the proxy's attention through the probe; lexical: BM25 and lexical features, no model, milliseconds",
        check=check_tier,
        # the server chooses the tier per request (--lexical-tier, --lexical-over-tokens, a request's own)
        text=TextForm(str, choices=TIERS, server=False),
    )
    """``"model"`` (the proxy's attention, or ``scorer``) or ``"lexical"`` (BM25 and lexical features through the
    shipped lexical probe: no model, milliseconds); per call too."""

    threads: ThreadPolicy | int | str = option(
        "auto",
        "CPU threads per forward pass: 'auto' (the cores free when the model loads), 'adaptive' (the cores free "
        "before each pass) or a number",
        check=check_threads,
        # the server's --threads has its own default (adaptive) and shares the cores among its workers
        text=TextForm(str, parse=thread_count, server=False),
    )
    """CPU threads per forward pass: ``"auto"`` (the cores free right now, see
    :class:`~rag_opt.models.threads.ThreadPolicy`), a number, or a policy. Applies to the loaded model,
    process-wide."""

    encoding: str = option(
        DEFAULT_ENCODING,
        "how the proxy model reads the context: parallel (each document on its own, its encoding cached by content) "
        "or joint (one pass over the whole context)",
        check=check_encoding,
        text=TextForm(str, choices=ENCODINGS),
    )
    """How the proxy reads the context: ``"parallel"`` (each document on its own, its encoding cached by content,
    then a question pass over the cached documents: a request with cached documents costs only its question) or
    ``"joint"`` (one causal pass over everything; its position profiles drive calibration). Default:
    :data:`~rag_opt.models.prompt.DEFAULT_ENCODING`."""

    cache: EncodingCache | int | str | None = option(
        "auto",
        "with --encoding parallel: the encoding cache's disk folder (e.g. one filled by 'rag-opt index')",
        # the server builds one cache for the process from its own settings (--cache-bytes, --cache-dir, ...)
        text=TextForm(str, flag="--cache-dir", metavar="DIR", shown="memory only", server=False),
    )
    """The document-encoding cache of parallel encoding: ``"auto"`` (in memory, 512 MiB), a size in bytes, a
    folder (the default memory tier plus that disk tier, shared by processes), an
    :class:`~rag_opt.models.encoding_cache.EncodingCache` (to share one between optimizers or with the server), or
    None (off)."""

    title_keys: Sequence[str] = option(
        DEFAULT_TITLE_KEYS,
        "comma-separated metadata keys a document's title is read from when it has no title field, in order (a "
        "file-name key such as source gives the file's stem; '' reads none)",
        check=check_title_keys,
        text=TextForm(str, parse=key_list, metavar="KEYS", shown=",".join(DEFAULT_TITLE_KEYS)),
        group="titles",
    )
    """The metadata keys a document's title is read from when it has no ``title`` field, in order (default
    :data:`~rag_opt.text.titles.DEFAULT_TITLE_KEYS`: title, doc_title, heading, name, source, file_path, file_name;
    a file-name key gives its file's stem). See :mod:`rag_opt.text.titles`."""

    title_from_text: bool = option(
        True,
        "read a leading heading line of a document's text as its title when it has no other",
        check=check_title_from_text,
        group="titles",
    )
    """Without a title field or metadata title, read a leading heading line of the text (a Markdown heading, or a
    short first line without end punctuation) as the title; the line stays in the text.
    ``OutputDocument.title_source`` says which title was used."""

    reader: str | None = option(
        None,
        "the model that reads the optimized context: its reader profile (rag-opt calibrate --reader) places the "
        "documents under --ordering calibrated (default: the target)",
        check=check_reader,
    )
    """The model that reads the optimized context, whose reader profile (``rag-opt calibrate --reader``) places
    the documents under ``ordering="calibrated"`` (default: the request's ``target``). Without a profile for it,
    the proxy's profile places them. ``OptimizeResult.placement_profile`` says which."""

    limits: WorkLimits | None = option(
        DEFAULT_LIMITS, "the most work one call may do (a rag_opt.WorkLimits)", check=check_limits, text=None
    )  # an object: the server and rag-opt mcp have their own limits (--max-units, ...)
    """The most work one call may do (:class:`~rag_opt.work.WorkLimits`: units, proxy tokens, question tokens),
    checked before the model runs. Default :data:`~rag_opt.work.DEFAULT_LIMITS` (65,536 proxy tokens: about a
    minute of the embedded model on 2 cores, cold); None lifts them. A caller's own :func:`rag_opt.work.scope` with
    limits (the server's) takes precedence."""

    over_limit: OverLimit | str = option(
        "raise",
        "past the work limits: raise an error naming the limit, or answer by the lexical tier",
        check=check_over_limit,
        # the server applies its own limits and answers past them by its own rules (--lexical-tier)
        text=TextForm(str, choices=OVER_LIMIT, server=False),
    )
    """Past the limits, ``"raise"`` a :class:`~rag_opt.errors.WorkLimitExceeded` naming the limit and how to lift
    it, or answer by the ``"lexical"`` tier (with a warning in the result saying so)."""

    def __post_init__(self) -> None:
        check_budget(self.ratio, self.target_tokens, self.threshold, self.budget)  # at most one budget
        for f in dataclasses.fields(self):
            check = _spec(f).check
            if check is not None:
                value = getattr(self, f.name)
                checked = check(value)
                if checked is not value:
                    object.__setattr__(self, f.name, checked)

    @property
    def default_budget(self) -> Budget:
        """The budget these options give (``ratio``, ``target_tokens``, ``threshold`` or ``budget``), else
        ``ratio=`` :data:`~rag_opt.types.DEFAULT_RATIO`."""
        return check_budget(self.ratio, self.target_tokens, self.threshold, self.budget) or Budget(ratio=DEFAULT_RATIO)

    def as_dict(self) -> dict[str, Any]:
        """Every option by name (shallow: objects such as a scorer are the same objects)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# -- the declaration, read -------------------------------------------------------------------------------------
def _spec(f: dataclasses.Field[Any]) -> OptionSpec:
    spec = f.metadata.get(_KEY)
    if not isinstance(spec, OptionSpec):
        raise TypeError(f"OptimizerOptions.{f.name} is not declared with rag_opt.options.option()")
    return spec


def _fields() -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(OptimizerOptions)}


def option_names() -> tuple[str, ...]:
    """Every option's name, in declaration order."""
    return tuple(_fields())


def option_spec(name: str) -> OptionSpec:
    """The :class:`OptionSpec` of option ``name``."""
    return _spec(_fields()[name])


def options_in_group(group: str) -> tuple[str, ...]:
    """The options of ``group`` (``budget``, ``proxy``, ``titles``), in declaration order."""
    return tuple(name for name, f in _fields().items() if _spec(f).group == group)
