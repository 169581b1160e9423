"""rag-opt from Python: compress ten retrieved paragraphs to a third of their tokens for one question."""

import json
from pathlib import Path

import rag_opt

here = Path(__file__).parent
question = (here / "hotpotqa_question.txt").read_text().strip()
documents = [json.loads(line) for line in (here / "hotpotqa_docs.jsonl").read_text().splitlines()]

result = rag_opt.optimize(question, documents, ratio=1 / 3)
print(result.context())
print(f"\n{result.tokens_before} -> {result.tokens_after} tokens ({result.ratio:.0%} kept), scorer: {result.scorer}")
for doc in result.documents:
    kept = sum(u.kept for u in doc.units)
    print(f"  {doc.id:<40} score={doc.score:.3f}  kept {kept}/{len(doc.units)} sentences")
