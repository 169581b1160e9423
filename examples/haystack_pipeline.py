"""rag-opt in a Haystack 3 pipeline: BM25 retrieval → rag-opt → prompt builder, offline (it prints the prompt).

Run from the repository root (needs ``pip install -e '.[haystack]'``)::

    python examples/haystack_pipeline.py

The document store holds the example question's ten HotpotQA paragraphs (``hotpotqa_docs.jsonl``), plus the
paragraphs of the first 300 HotpotQA dev questions when ``../shared/data`` is there. ``InMemoryBM25Retriever``
retrieves six of them, :class:`~rag_opt.adapters.haystack.RagOptDocumentCompressor` keeps 40% of their tokens
(the sentences that matter for the question, verbatim) and puts the best documents at both ends of the context,
and ``PromptBuilder`` renders the prompt an LLM would receive. The pipeline is then saved as YAML and loaded back.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import sys
from pathlib import Path

# the example runs offline: Haystack's anonymous usage telemetry stays off unless you set the variable yourself
os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")

from haystack import Document, Pipeline  # noqa: E402
from haystack.components.builders import PromptBuilder  # noqa: E402
from haystack.components.retrievers.in_memory import InMemoryBM25Retriever  # noqa: E402
from haystack.document_stores.in_memory import InMemoryDocumentStore  # noqa: E402
from haystack.document_stores.types import DuplicatePolicy  # noqa: E402

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(HERE.parent))

# the component's public import path (Haystack's integration namespace); rag_opt.adapters.haystack is the same class
from haystack_integrations.components.compressors.rag_opt import RagOptDocumentCompressor  # noqa: E402

HOTPOT_DEV = HERE.parent.parent / "shared" / "data" / "hotpotqa" / "dev.jsonl.gz"

TEMPLATE = """Answer the question from the documents.
{% for doc in documents %}
[{{ loop.index }}] {{ doc.meta['title'] }}
{{ doc.content }}
{% endfor %}
Question: {{ question }}
Answer:"""


def load_documents() -> list[Document]:
    """The example's ten paragraphs, plus HotpotQA dev paragraphs from ../shared/data when present."""
    records = [json.loads(line) for line in (HERE / "hotpotqa_docs.jsonl").read_text(encoding="utf-8").splitlines()]
    docs = {r["title"]: r["text"] for r in records}
    if HOTPOT_DEV.is_file():
        with gzip.open(HOTPOT_DEV, "rt", encoding="utf-8") as fh:
            for n, line in enumerate(fh):
                if n >= 300:
                    break
                for title, sentences in json.loads(line)["context"]:
                    docs.setdefault(title, "".join(sentences))
    else:
        print(f"({HOTPOT_DEV} is absent: the store holds the example's ten paragraphs only)\n")
    return [Document(content=text, meta={"title": title, "source": "hotpotqa"}) for title, text in docs.items()]


def build_pipeline(store: InMemoryDocumentStore) -> Pipeline:
    pipe = Pipeline()
    pipe.add_component("retriever", InMemoryBM25Retriever(document_store=store, top_k=6))
    pipe.add_component("compressor", RagOptDocumentCompressor(ratio=0.4, ordering="lost_in_the_middle"))
    pipe.add_component("prompt_builder", PromptBuilder(template=TEMPLATE, required_variables=["question", "documents"]))
    pipe.connect("retriever.documents", "compressor.documents")
    pipe.connect("compressor.documents", "prompt_builder.documents")
    return pipe


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    question = (HERE / "hotpotqa_question.txt").read_text(encoding="utf-8").strip()
    store = InMemoryDocumentStore(index="rag-opt-example")
    store.write_documents(load_documents(), policy=DuplicatePolicy.SKIP)
    pipe = build_pipeline(store)
    data = {
        "retriever": {"query": question},
        "compressor": {"query": question},
        "prompt_builder": {"question": question},
    }
    out = pipe.run(data, include_outputs_from={"retriever", "compressor"})

    retrieved = out["retriever"]["documents"]
    print(f"{store.count_documents()} documents in the store; BM25 retrieved {len(retrieved)} for: {question}\n")
    for doc in out["compressor"]["documents"]:
        info = doc.meta["rag_opt"]
        kept = sum(u["kept"] for u in info["units"])
        print(
            f"#{info['rank'] + 1} (retrieved #{info['index'] + 1}) {doc.meta['title']!r}: bm25 {doc.score:.2f}, "
            f"rag-opt {info['score']:.3f}, {kept}/{len(info['units'])} sentences, "
            f"{info['tokens_before']} → {info['tokens_after']} tokens"
        )
    print(f"\nThe prompt the LLM receives:\n\n{out['prompt_builder']['prompt']}")

    # the pipeline as YAML loads back as it is: the component's type lives in Haystack's trusted namespace
    yaml = pipe.dumps()
    loaded = Pipeline.loads(yaml)
    same = loaded.run(data)["prompt_builder"]["prompt"] == out["prompt_builder"]["prompt"]
    print(f"\nSaved as YAML ({len(yaml)} characters) and loaded back with Pipeline.loads: same prompt: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
