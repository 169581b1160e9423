"""rag-opt: optimize the context between your retriever and your LLM."""
