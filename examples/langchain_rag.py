"""A LangChain RAG chain with rag-opt between the retriever and the LLM.

    BM25 retriever over HotpotQA Wikipedia paragraphs → rag-opt (compress + reorder) → prompt → chat model

Run from the repository root::

    python examples/langchain_rag.py                          # the question in examples/hotpotqa_question.txt
    python examples/langchain_rag.py --question "..." --k 8 --ratio 0.4

The corpus is every paragraph of the first ``--corpus-questions`` HotpotQA dev questions
(``../shared/data/hotpotqa/dev.jsonl.gz``) plus ``examples/hotpotqa_docs.jsonl``; without the shared data it is
just the latter. The chat model is ``ChatOpenAI`` when ``OPENAI_API_KEY`` is set and ``langchain-openai`` is
installed (``OPENAI_BASE_URL`` and ``RAG_OPT_CHAT_MODEL`` optional, e.g. a local OpenAI-compatible server);
otherwise the chain stops at the prompt and the example prints it. Everything else runs offline.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import logging
import os
import sys
from operator import itemgetter
from pathlib import Path
from typing import Any

import bm25s
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough
from pydantic import PrivateAttr

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from rag_opt import ContextOptimizer  # noqa: E402
from rag_opt.adapters.langchain import RagOptRunnable, format_documents  # noqa: E402

logger = logging.getLogger("langchain_rag")

HOTPOT_DEV = ROOT.parent / "shared" / "data" / "hotpotqa" / "dev.jsonl.gz"

PROMPT = ChatPromptTemplate.from_messages(
    [
        ("system", "Answer the question using only the context. Answer with a short phrase."),
        ("human", "Context:\n{context}\n\nQuestion: {question}"),
    ]
)


class BM25Retriever(BaseRetriever):
    """A small BM25 retriever (the ``bm25s`` library) over in-memory LangChain ``Document`` s."""

    documents: list[Document]
    k: int = 6
    _index: Any = PrivateAttr(default=None)

    def model_post_init(self, context: Any) -> None:
        if not self.documents:
            raise ValueError("BM25Retriever needs at least one document")
        texts = [f"{d.metadata.get('title', '')}. {d.page_content}" for d in self.documents]
        self._index = bm25s.BM25()
        self._index.index(bm25s.tokenize(texts, stopwords="en", show_progress=False), show_progress=False)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        words = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
        known = [w for w in words if w in self._index.vocab_dict]
        if not known:  # no query term occurs in the corpus
            return []
        ids, scores = self._index.retrieve([known], k=min(self.k, len(self.documents)), show_progress=False)
        out = []
        for i, score in zip(ids[0], scores[0], strict=True):
            doc = self.documents[int(i)]
            out.append(
                Document(page_content=doc.page_content, metadata={**doc.metadata, "bm25": float(score)}, id=doc.id)
            )
        return out


def load_corpus(corpus_questions: int = 300) -> list[Document]:
    """HotpotQA paragraphs as Documents (one per Wikipedia title), each with its title and source."""
    seen: dict[str, Document] = {}

    def add(title: str, text: str, source: str) -> None:
        if title not in seen:
            seen[title] = Document(page_content=text, metadata={"title": title, "source": source}, id=title)

    for line in (HERE / "hotpotqa_docs.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        add(rec["title"], rec["text"], "examples/hotpotqa_docs.jsonl")
    if HOTPOT_DEV.is_file() and corpus_questions > 0:
        with gzip.open(HOTPOT_DEV, "rt", encoding="utf-8") as fh:
            for n, line in enumerate(fh):
                if n >= corpus_questions:
                    break
                for title, sentences in json.loads(line)["context"]:
                    add(title, "".join(sentences), "hotpotqa/dev")
    elif not HOTPOT_DEV.is_file():
        logger.warning("%s not found: the corpus is only examples/hotpotqa_docs.jsonl", HOTPOT_DEV)
    return list(seen.values())


def build_chain(retriever: BaseRetriever, optimizer: RagOptRunnable, llm: BaseChatModel | None = None) -> Runnable:
    """question → {question, documents (retrieved), optimized, context, prompt, answer?}."""
    chain = (
        RunnableParallel(question=RunnablePassthrough(), documents=retriever)
        | RunnablePassthrough.assign(optimized=optimizer)
        | RunnablePassthrough.assign(context=itemgetter("optimized") | RunnableLambda(format_documents))
        | RunnablePassthrough.assign(prompt=PROMPT)
    )
    if llm is not None:
        chain = chain | RunnablePassthrough.assign(answer=itemgetter("prompt") | llm | StrOutputParser())
    return chain.with_config(run_name="rag_opt_rag_chain")


def chat_model_from_env() -> BaseChatModel | None:
    """``ChatOpenAI`` when ``OPENAI_API_KEY`` is set and langchain-openai is installed, else None."""
    if not os.environ.get("OPENAI_API_KEY"):
        return None
    if importlib.util.find_spec("langchain_openai") is None:
        logger.warning("OPENAI_API_KEY is set but langchain-openai is not installed: showing the prompt instead")
        return None
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=os.environ.get("RAG_OPT_CHAT_MODEL", "gpt-4o-mini"),
        base_url=os.environ.get("OPENAI_BASE_URL") or None,
        temperature=0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--question", default=(HERE / "hotpotqa_question.txt").read_text(encoding="utf-8").strip())
    parser.add_argument("--k", type=int, default=6, help="documents to retrieve")
    parser.add_argument("--ratio", type=float, default=0.4, help="fraction of the context's tokens to keep")
    parser.add_argument("--ordering", default="lost_in_the_middle")
    parser.add_argument("--corpus-questions", type=int, default=300, help="HotpotQA dev questions in the corpus")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets its own logger to DEBUG on import

    corpus = load_corpus(args.corpus_questions)
    retriever = BM25Retriever(documents=corpus, k=args.k)
    optimizer = RagOptRunnable(optimizer=ContextOptimizer(), ratio=args.ratio, ordering=args.ordering)
    llm = chat_model_from_env()
    out = build_chain(retriever, optimizer, llm).invoke(args.question)

    before = sum(d.metadata["rag_opt"]["tokens_before"] for d in out["optimized"])
    kept = len(out["optimized"])
    print(f"corpus: {len(corpus)} paragraphs; retrieved {len(out['documents'])}, kept {kept}")
    for d in out["optimized"]:
        info = d.metadata["rag_opt"]
        print(
            f"  #{info['rank'] + 1} {d.metadata['title']!r} (retrieved #{info['index'] + 1}, bm25 "
            f"{d.metadata['bm25']:.2f}, rag-opt {info['score']:.3f}): {info['tokens_before']} → "
            f"{info['tokens_after']} tokens"
        )
    total_before = optimizer.optimizer.counter.count(format_documents(out["documents"]))
    total_after = optimizer.optimizer.counter.count(out["context"])
    print(f"context: {total_before} → {total_after} tokens ({before} in the kept documents before compression)\n")
    if "answer" in out:
        print(f"Question: {args.question}\nAnswer: {out['answer']}")
    else:
        print("No chat model configured (set OPENAI_API_KEY, optionally OPENAI_BASE_URL); the prompt is:\n")
        for message in out["prompt"].to_messages():
            print(f"[{message.type}]\n{message.content}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
