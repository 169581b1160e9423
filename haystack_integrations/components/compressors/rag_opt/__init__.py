"""rag-opt's Haystack component under Haystack's integration namespace.

Haystack's pipeline loader (``Pipeline.loads``/``Pipeline.from_dict``) imports component classes only from
trusted namespaces (``haystack``, ``haystack_integrations``, ``haystack_experimental``) unless the caller extends
its allowlist. Third-party components follow the integration convention: a namespace package
``haystack_integrations.components.<kind>.<name>``. This module is that import path for rag-opt; the component
is defined (and registered under this path) in :mod:`rag_opt.adapters.haystack`::

    from haystack_integrations.components.compressors.rag_opt import RagOptDocumentCompressor

``haystack_integrations``, ``haystack_integrations.components`` and ``haystack_integrations.components.compressors``
are implicit namespace packages (no ``__init__.py``), shared with every other installed integration.
"""

from rag_opt.adapters.haystack import RagOptDocumentCompressor

__all__ = ["RagOptDocumentCompressor"]
