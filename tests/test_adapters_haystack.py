"""The Haystack component in a real pipeline over HotpotQA paragraphs: ``InMemoryDocumentStore`` +
``InMemoryBM25Retriever`` → rag-opt → ``PromptBuilder``, run sync and async, and through ``to_dict``/``from_dict``
and the pipeline's YAML.

Skipped when haystack-ai (the ``haystack`` extra) is not installed; the pipeline tests skip without
``../shared/data``. The pipeline runs the real embedded proxy model, loaded once for the module.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")  # nothing leaves the machine (subprocesses inherit it)
pytest.importorskip("haystack", reason="haystack-ai is not installed (pip install -e '.[haystack]')")

from haystack import Document, Pipeline  # noqa: E402
from haystack.components.builders import PromptBuilder  # noqa: E402
from haystack.components.retrievers.in_memory import InMemoryBM25Retriever  # noqa: E402
from haystack.core.errors import DeserializationError, PipelineRuntimeError  # noqa: E402
from haystack.dataclasses import ByteStream  # noqa: E402
from haystack.document_stores.in_memory import InMemoryDocumentStore  # noqa: E402
from haystack.document_stores.types import DuplicatePolicy  # noqa: E402

from rag_opt.adapters.haystack import COMPONENT_MODULE, METADATA_KEY, RagOptDocumentCompressor  # noqa: E402
from rag_opt.adapters.options import optimizer_options  # noqa: E402
from rag_opt.compressors.baselines import BM25Scorer  # noqa: E402
from rag_opt.errors import ConfigurationError, InvalidInputError, InvalidInputTypeError  # noqa: E402
from rag_opt.install import install_hint  # noqa: E402
from rag_opt.pipeline import ContextOptimizer  # noqa: E402
from rag_opt.text.tokens import get_token_counter  # noqa: E402
from tests.helpers import assert_verbatim, hotpot_dev  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TYPE = "haystack_integrations.components.compressors.rag_opt.RagOptDocumentCompressor"
INDEX = "rag-opt-tests-hotpotqa"  # InMemoryDocumentStores with one index share their documents (also after YAML)
TEMPLATE = """Answer the question from the documents.
{% for doc in documents %}
[{{ loop.index }}] {{ doc.meta['title'] }}
{{ doc.content }}
{% endfor %}
Question: {{ question }}
Answer:"""
SETTINGS: dict[str, Any] = {"ratio": 0.4, "ordering": "lost_in_the_middle"}
CAPITAL = "What is the capital of France?"


# -- fixtures ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def examples() -> list[dict[str, Any]]:
    return hotpot_dev(40)


@pytest.fixture(scope="module")
def store(examples: list[dict[str, Any]]) -> InMemoryDocumentStore:
    seen: dict[str, Document] = {}
    for ex in examples:
        for title, sentences in ex["context"]:
            if title not in seen:
                seen[title] = Document(content="".join(sentences), meta={"title": title, "source": "hotpotqa/dev"})
    store = InMemoryDocumentStore(index=INDEX)
    store.write_documents(list(seen.values()), policy=DuplicatePolicy.SKIP)
    return store


@pytest.fixture(scope="module")
def model() -> None:
    """The embedded proxy model, loaded once for the module (rag-opt keeps it per process: every component and
    optimizer below reuses it)."""
    RagOptDocumentCompressor().warm_up()


def build_pipeline(store: InMemoryDocumentStore, compressor: RagOptDocumentCompressor) -> Pipeline:
    pipe = Pipeline()
    pipe.add_component("retriever", InMemoryBM25Retriever(document_store=store, top_k=5))
    pipe.add_component("compressor", compressor)
    pipe.add_component("prompt_builder", PromptBuilder(template=TEMPLATE, required_variables=["question", "documents"]))
    pipe.connect("retriever.documents", "compressor.documents")
    pipe.connect("compressor.documents", "prompt_builder.documents")
    return pipe


def pipeline_input(question: str) -> dict[str, Any]:
    return {
        "retriever": {"query": question},
        "compressor": {"query": question},
        "prompt_builder": {"question": question},
    }


OUTPUTS = {"retriever", "compressor", "prompt_builder"}


@pytest.fixture(scope="module")
def question(examples: list[dict[str, Any]]) -> str:
    return str(examples[5]["question"])


@pytest.fixture(scope="module")
def sync_run(store: InMemoryDocumentStore, question: str, model: None) -> tuple[Pipeline, dict[str, Any]]:
    pipe = build_pipeline(store, RagOptDocumentCompressor(**SETTINGS))
    return pipe, pipe.run(pipeline_input(question), include_outputs_from=OUTPUTS)


def _view(documents: list[Document]) -> list[tuple[str, str | None, float | None, int]]:
    return [(d.id, d.content, d.score, d.meta[METADATA_KEY]["rank"]) for d in documents]


def _same_documents(a: list[Document], b: list[Document]) -> None:
    """Same documents, text, order and metadata; rag-opt's scores equal up to float rounding."""
    assert _view(a) == _view(b)
    for x, y in zip(a, b, strict=True):
        ix, iy = x.meta[METADATA_KEY], y.meta[METADATA_KEY]
        assert {k: v for k, v in ix.items() if k not in ("score", "raw_score", "units")} == {
            k: v for k, v in iy.items() if k not in ("score", "raw_score", "units")
        }
        assert ix["score"] == pytest.approx(iy["score"], rel=1e-4, abs=1e-6)
        assert {k: v for k, v in x.meta.items() if k != METADATA_KEY} == {
            k: v for k, v in y.meta.items() if k != METADATA_KEY
        }


def _normalised(data: dict[str, Any]) -> dict[str, Any]:
    """A pipeline's dict with its connections in a fixed order (Haystack lists them in graph order)."""
    return {**data, "connections": sorted(data["connections"], key=lambda c: (c["sender"], c["receiver"]))}


# -- the real pipeline ------------------------------------------------------------------------------------------
@pytest.mark.model
@pytest.mark.data
def test_pipeline_compresses_verbatim_and_keeps_metadata(sync_run: tuple[Pipeline, dict[str, Any]]) -> None:
    _, out = sync_run
    retrieved: list[Document] = out["retriever"]["documents"]
    compressed: list[Document] = out["compressor"]["documents"]
    assert len(retrieved) == 5 and 0 < len(compressed) <= len(retrieved)
    count = get_token_counter(None).count  # the default target tokenizer
    before = sum(count(d.content or "") for d in retrieved)
    after = sum(count(d.content or "") for d in compressed)
    assert after < before * 0.6  # ratio 0.4 of the target tokens (the split into documents costs a few)
    by_id = {d.id: d for d in retrieved}
    assert len({d.id for d in compressed}) == len(compressed)
    for rank, doc in enumerate(compressed):
        original = by_id[doc.id]  # the id is kept
        text = original.content or ""
        info = doc.meta[METADATA_KEY]
        assert info["rank"] == rank and retrieved[info["index"]].id == doc.id
        assert info["tier"] == "model" and info["scorer"] in ("probe", "raw-attention")
        assert isinstance(info["score"], float) and info["tokens_after"] <= info["tokens_before"]
        assert {k: v for k, v in doc.meta.items() if k != METADATA_KEY} == original.meta  # metadata kept
        assert doc.score == original.score  # the retriever's score is kept
        assert METADATA_KEY not in original.meta  # inputs are not modified
        assert_verbatim(doc.content or "", text)  # kept sentences verbatim, in order
        spans = info["kept_spans"]
        assert spans and spans[-1][1] <= len(text)
        assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:], strict=False))  # in order, disjoint
        assert "".join(text[s:e] for s, e in spans).split() == (doc.content or "").split()  # exactly the spans
    prompt = out["prompt_builder"]["prompt"]
    assert all((d.content or "").strip() in prompt for d in compressed)
    assert "kept_spans" not in prompt and "raw_score" not in prompt  # rag-opt's metadata stays out of the prompt
    kept = {d.id for d in compressed}
    assert all((d.content or "").strip() not in prompt for d in retrieved if d.id not in kept)


@pytest.mark.model
@pytest.mark.data
def test_pipeline_order_is_rag_opts(sync_run: tuple[Pipeline, dict[str, Any]], question: str) -> None:
    _, out = sync_run
    retrieved: list[Document] = out["retriever"]["documents"]
    direct = ContextOptimizer().optimize(
        question,
        [{"id": d.id, "text": d.content, "metadata": d.meta, "score": d.score} for d in retrieved],
        **SETTINGS,
    )
    compressed = out["compressor"]["documents"]
    assert [(d.id, d.text) for d in direct.documents] == [(d.id, d.content) for d in compressed]
    assert [d.index for d in direct.documents] == [d.meta[METADATA_KEY]["index"] for d in compressed]
    assert direct.ordering == "lost_in_the_middle"  # SETTINGS' ordering, not the default


@pytest.mark.model
@pytest.mark.data
def test_async_pipeline_gives_the_same_documents(
    sync_run: tuple[Pipeline, dict[str, Any]], store: InMemoryDocumentStore, question: str
) -> None:
    _, out = sync_run
    pipe = build_pipeline(store, RagOptDocumentCompressor(**SETTINGS))  # a fresh component: nothing cached
    assert pipe.get_component("compressor").__haystack_supports_async__  # type: ignore[attr-defined]
    async_out = asyncio.run(pipe.run_async(pipeline_input(question), include_outputs_from=OUTPUTS))
    assert [d.id for d in async_out["retriever"]["documents"]] == [d.id for d in out["retriever"]["documents"]]
    _same_documents(async_out["compressor"]["documents"], out["compressor"]["documents"])
    assert async_out["prompt_builder"]["prompt"] == out["prompt_builder"]["prompt"]


@pytest.mark.model
@pytest.mark.data
def test_concurrent_async_runs_agree_with_sync(
    sync_run: tuple[Pipeline, dict[str, Any]], store: InMemoryDocumentStore, question: str
) -> None:
    """Several run_async calls at once (micro-batched together) each give what run gives.

    In float32: a micro-batch runs the proxy's linear layers over the batch's questions together, and in bfloat16
    (the default on CPUs with native bf16) a matrix product's rounding depends on its shape, so batched and single
    scores differ there by bf16 rounding (~1e-3). The claim tested is the exact one: same computation."""
    _, out = sync_run
    retrieved = out["retriever"]["documents"]
    comp = RagOptDocumentCompressor(**SETTINGS, dtype="float32")
    single = comp.run(query=question, documents=retrieved)["documents"]
    assert [d.id for d in single] == [d.id for d in out["compressor"]["documents"]]

    async def three() -> list[dict[str, list[Document]]]:
        return list(await asyncio.gather(*(comp.run_async(query=question, documents=retrieved) for _ in range(3))))

    for result in asyncio.run(three()):
        _same_documents(result["documents"], single)


@pytest.mark.model
@pytest.mark.data
def test_pipeline_yaml_round_trip_runs_the_same(
    sync_run: tuple[Pipeline, dict[str, Any]], question: str, tmp_path: Path
) -> None:
    pipe, out = sync_run
    yaml = pipe.dumps()
    assert f"type: {TYPE}" in yaml
    loaded = Pipeline.loads(yaml)  # no allowed_modules: the component's namespace is trusted by default
    assert _normalised(loaded.to_dict()) == _normalised(pipe.to_dict())
    comp = loaded.get_component("compressor")
    assert isinstance(comp, RagOptDocumentCompressor) and comp is not pipe.get_component("compressor")
    again = loaded.run(pipeline_input(question), include_outputs_from=OUTPUTS)
    _same_documents(again["compressor"]["documents"], out["compressor"]["documents"])
    assert again["prompt_builder"]["prompt"] == out["prompt_builder"]["prompt"]
    # and in a fresh interpreter that never imported rag-opt: Haystack imports the component from its trusted
    # namespace module (loading it loads no model)
    (tmp_path / "pipeline.yml").write_text(yaml, encoding="utf-8")
    code = (
        "import sys; from haystack import Pipeline\n"
        "assert not any(m == 'rag_opt' or m.startswith(('rag_opt.', 'haystack_integrations')) for m in sys.modules)\n"
        "pipe = Pipeline.loads(open('pipeline.yml').read())\n"
        "comp = pipe.get_component('compressor')\n"
        "print(type(comp).__module__, type(comp).__name__, comp.ratio, comp.ordering)\n"
        "assert 'transformers' not in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [COMPONENT_MODULE, "RagOptDocumentCompressor", "0.4", "lost_in_the_middle"]


# -- serialisation ----------------------------------------------------------------------------------------------
def test_to_dict_from_dict_round_trip_every_init_parameter() -> None:
    every = {
        name: p.default
        for name, p in inspect.signature(ContextOptimizer.__init__).parameters.items()
        if name in optimizer_options()
    }
    assert {"model", "keep_best_per_doc", "tier", "language", "cache", "threads", "scorer"} <= set(every)
    # limits' default is an object (a WorkLimits): given as None, as a plain value serialises
    every.update(keep_best_per_doc=True, tier="lexical", language="de", max_window_tokens=4096, cache=None, limits=None)
    every = {k: list(v) if isinstance(v, tuple) else v for k, v in every.items()}  # as YAML gives them back
    comp = RagOptDocumentCompressor(target_tokens=300, ordering="relevance", metadata_key="ro", **every)
    data = comp.to_dict()
    assert data["type"] == TYPE
    params = data["init_parameters"]
    assert set(params) == {"ratio", "target_tokens", "threshold", "ordering", "metadata_key", *every}
    assert params["target_tokens"] == 300 and params["ratio"] is None and params["metadata_key"] == "ro"
    again = RagOptDocumentCompressor.from_dict(data)
    assert again.to_dict() == data
    assert again.optimizer.tier == "lexical" and again.optimizer.language == "de"
    assert again.optimizer.selection_options.keep_best_per_doc is True and again.optimizer.cache is None
    # the defaults: only the component's own parameters
    plain = RagOptDocumentCompressor()
    assert plain.to_dict() == {
        "type": TYPE,
        "init_parameters": {
            "ratio": None,
            "target_tokens": None,
            "threshold": None,
            "ordering": None,
            "metadata_key": METADATA_KEY,
        },
    }
    assert RagOptDocumentCompressor.from_dict(plain.to_dict()).to_dict() == plain.to_dict()


def test_budget_option_serialises_as_its_fields() -> None:
    from rag_opt import Budget

    comp = RagOptDocumentCompressor(budget=Budget(threshold=0.3))
    assert comp.threshold == 0.3 and comp.to_dict()["init_parameters"]["threshold"] == 0.3


def test_what_does_not_serialise_is_refused_clearly() -> None:
    with pytest.raises(ConfigurationError, match="optimizer= cannot be serialised"):
        RagOptDocumentCompressor(optimizer=ContextOptimizer(tier="lexical")).to_dict()
    with pytest.raises(ConfigurationError, match="scorer"):
        RagOptDocumentCompressor(scorer=BM25Scorer()).to_dict()
    data = RagOptDocumentCompressor(ratio=0.5).to_dict()
    with pytest.raises(InvalidInputError, match="did you mean 'ratio'"):
        RagOptDocumentCompressor.from_dict({**data, "init_parameters": {"rato": 0.5}})
    smuggled = {"type": "subprocess.Popen", "init_parameters": {"args": ["true"]}}
    with pytest.raises(InvalidInputTypeError, match="plain values"):  # nothing is imported
        RagOptDocumentCompressor.from_dict({**data, "init_parameters": {"scorer": smuggled}})
    with pytest.raises(DeserializationError):
        RagOptDocumentCompressor.from_dict({**data, "type": "rag_opt.adapters.haystack.Other"})


# -- behaviour without the model --------------------------------------------------------------------------------
def _docs() -> list[Document]:
    return [
        Document(content="Paris is the capital of France. It has the Eiffel tower.", meta={"title": "Paris"}, score=2),
        Document(blob=ByteStream(data=b"\x89PNG", mime_type="image/png"), meta={"title": "a picture"}),
        Document(content="Bananas are a yellow fruit. Monkeys like them a lot.", meta={"title": "Bananas"}, score=1),
        Document(content="   ", meta={"title": "blank"}),
        Document(content="France borders Spain and Italy.", meta={"lang": "en"}, score=0.5),
    ]


def test_documents_without_text_pass_through_and_ratio_one_keeps_all() -> None:
    docs = _docs()
    comp = RagOptDocumentCompressor(ratio=1.0, scorer=BM25Scorer(), ordering="input")
    out = comp.run(query=CAPITAL, documents=docs)["documents"]
    assert [d.id for d in out] == [docs[i].id for i in (0, 2, 4, 1, 3)]
    assert [d.content for d in out[:3]] == [docs[i].content for i in (0, 2, 4)]
    assert out[3] is docs[1] and out[4] is docs[3]  # passed through untouched, after the optimized ones
    assert [d.meta[METADATA_KEY]["index"] for d in out[:3]] == [0, 2, 4]  # positions in the input


def test_budget_per_call_and_documents_with_nothing_kept_left_out() -> None:
    docs = [d for d in _docs() if d.content and d.content.strip()]
    comp = RagOptDocumentCompressor(ratio=1.0, scorer=BM25Scorer(), ordering="input")
    out = comp.run(query=CAPITAL, documents=docs, target_tokens=12)["documents"]  # this call's budget
    assert sum(d.meta[METADATA_KEY]["tokens_after"] for d in out) <= 12
    assert [d.id for d in out] == [docs[0].id] and out[0].content == "Paris is the capital of France."
    assert out[0].meta["title"] == "Paris" and out[0].score == 2
    relevance = comp.run(query="Which fruit do monkeys like?", documents=docs, ordering="relevance")["documents"]
    assert relevance[0].id == docs[1].id and len(relevance) == 3  # ratio 1: everything, best first


def test_title_comes_from_meta() -> None:
    comp = RagOptDocumentCompressor(ratio=1.0, scorer=BM25Scorer(), ordering="input")
    results: list[Any] = []
    optimize = comp.optimizer.optimize

    def spy(query: str, documents: Any, **kw: Any) -> Any:
        results.append((documents, optimize(query, documents, **kw)))
        return results[-1][1]

    comp.optimizer.optimize = spy  # type: ignore[method-assign]
    docs = _docs()
    out = comp.run(query=CAPITAL, documents=docs)["documents"]
    ((given, result),) = results
    assert [(d.id, d.score, d.metadata) for d in given] == [
        (docs[i].id, docs[i].score, docs[i].meta) for i in (0, 2, 4)
    ]
    assert [d.title for d in result.documents] == ["Paris", "Bananas", None]
    assert [d.content for d in out[:3]] == [docs[i].content for i in (0, 2, 4)]  # the title never enters content


def test_empty_and_textless_inputs() -> None:
    comp = RagOptDocumentCompressor(scorer=BM25Scorer())
    assert comp.run(query=CAPITAL, documents=[]) == {"documents": []}
    blob = [_docs()[1]]
    assert comp.run(query=CAPITAL, documents=blob)["documents"][0] is blob[0]
    assert asyncio.run(comp.run_async(query=CAPITAL, documents=blob))["documents"][0] is blob[0]


def test_async_without_the_model() -> None:
    comp = RagOptDocumentCompressor(target_tokens=30, scorer=BM25Scorer())
    docs = _docs()
    sync = comp.run(query=CAPITAL, documents=docs)["documents"]
    asynchronous = asyncio.run(comp.run_async(query=CAPITAL, documents=docs))["documents"]
    assert [(d.id, d.content, d.meta) for d in sync] == [(d.id, d.content, d.meta) for d in asynchronous]


def test_unknown_option_refused_with_hint() -> None:
    with pytest.raises(InvalidInputError, match="did you mean 'ratio'"):
        RagOptDocumentCompressor(rati=0.5)
    with pytest.raises(InvalidInputError, match="did you mean 'keep_best_per_doc'"):
        RagOptDocumentCompressor(keep_best_per_document=True)
    with pytest.raises(InvalidInputError, match="not both"):
        RagOptDocumentCompressor(optimizer=ContextOptimizer(), tier="lexical")


def test_bad_input() -> None:
    comp = RagOptDocumentCompressor(ratio=0.5, scorer=BM25Scorer())
    doc = Document(content="Paris is the capital of France.")
    with pytest.raises(InvalidInputTypeError, match="query must be a string"):
        comp.run(query=3, documents=[doc])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="query is empty"):
        comp.run(query=" ", documents=[doc])
    with pytest.raises(InvalidInputTypeError, match="list of Haystack Documents"):
        comp.run(query=CAPITAL, documents="Paris")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputTypeError, match=r"documents\[1\]: expected a Haystack Document, got dict"):
        comp.run(query=CAPITAL, documents=[doc, {"content": "x"}])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="at most one of"):
        comp.run(query=CAPITAL, documents=[doc], ratio=0.5, threshold=0.5)
    with pytest.raises(InvalidInputError, match="ratio must be in"):
        comp.run(query=CAPITAL, documents=[doc], ratio=2.0)
    with pytest.raises(InvalidInputError, match="unknown ordering"):
        comp.run(query=CAPITAL, documents=[doc], ordering="sideways")
    with pytest.raises(InvalidInputTypeError, match="query must be a string"):
        asyncio.run(comp.run_async(query=None, documents=[doc]))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="at most one of"):
        RagOptDocumentCompressor(ratio=0.5, threshold=0.5)
    with pytest.raises(InvalidInputError, match="target_tokens"):
        RagOptDocumentCompressor(target_tokens=-3)
    with pytest.raises(InvalidInputError, match="unknown ordering"):
        RagOptDocumentCompressor(ordering="sideways")
    with pytest.raises(InvalidInputTypeError, match="metadata_key"):
        RagOptDocumentCompressor(metadata_key="")
    # in a pipeline, Haystack wraps the component's error; the cause is rag-opt's
    pipe = Pipeline()
    pipe.add_component("compressor", RagOptDocumentCompressor(scorer=BM25Scorer()))
    with pytest.raises(PipelineRuntimeError) as info:
        pipe.run({"compressor": {"query": 3, "documents": [doc]}})
    assert isinstance(info.value.__cause__, InvalidInputTypeError)


# -- lifecycle and imports --------------------------------------------------------------------------------------
@pytest.mark.model
def test_warm_up_loads_once(model: None) -> None:
    comp = RagOptDocumentCompressor()
    comp.warm_up()
    scorer = comp.optimizer.scorer()
    comp.warm_up()
    asyncio.run(comp.warm_up_async())
    assert comp.optimizer.scorer() is scorer
    lexical = RagOptDocumentCompressor(tier="lexical")
    asyncio.run(lexical.warm_up_async())
    assert lexical.optimizer._scorer is None  # the lexical tier needs no model  # noqa: SLF001


def test_importing_and_building_loads_no_model() -> None:
    code = (
        "import sys, rag_opt.adapters.haystack as m\n"
        "m.RagOptDocumentCompressor(ratio=0.5).to_dict()\n"
        "import rag_opt.models.loader as loader\n"
        "assert 'transformers' not in sys.modules and not loader._LOADED\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]


def test_import_without_haystack_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['haystack'] = None\n"
        "try:\n    import rag_opt.adapters.haystack\nexcept ImportError as exc:\n    print(exc)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "needs haystack-ai" in run.stdout and install_hint("haystack") in run.stdout


def test_the_namespace_module_is_the_component() -> None:
    from haystack import component

    from haystack_integrations.components.compressors.rag_opt import RagOptDocumentCompressor as Exported

    assert Exported is RagOptDocumentCompressor and component.registry[TYPE] is RagOptDocumentCompressor
