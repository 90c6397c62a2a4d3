"""Text for continued pretraining and for evaluation: corpora, packing into blocks, and the held-out sets.

A library tier (it imports only the package's errors), used by the ``taper`` command, by ``eval``, by the
README's quickstart and by the research scripts alike, so each reads the same blocks the same way:

- :func:`embedded_corpus`, :func:`embedded_corpus_files`, :func:`stdlib_directory`, :func:`load_text_dataset`,
  :class:`DataError` (sources.py): the embedded default corpus (one document per Python standard-library source
  file), a local file or folder, or a Hub dataset, as documents;
- :func:`load_documents`, :func:`text_column_of`, :func:`pack_documents`,
  :func:`prepare_data`, :class:`PackedData`, :func:`blocks_tensor` (corpus.py): documents to packed blocks that
  each start with the sink, the held-out documents chosen by a hash of their text (:func:`is_heldout`,
  :func:`heldout_documents`);
- :class:`EvaluationSet`, :func:`sample_blocks`, :func:`python_docs_documents` (heldout.py): blocks drawn
  from random positions of held-out text, and the out-of-corpus text (the Python documentation);
- :func:`out_of_corpus_set` (out_of_corpus.py): that out-of-corpus set for a tokenizer and sink.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "DataError": "sources",
    "PackedData": "corpus",
    "blocks_tensor": "corpus",
    "embedded_corpus": "sources",
    "embedded_corpus_files": "sources",
    "heldout_documents": "corpus",
    "is_heldout": "corpus",
    "load_documents": "corpus",
    "load_text_dataset": "sources",
    "pack_documents": "corpus",
    "prepare_data": "corpus",
    "stdlib_directory": "sources",
    "text_column_of": "corpus",
    "EvaluationSet": "heldout",
    "python_docs_documents": "heldout",
    "sample_blocks": "heldout",
    "out_of_corpus_set": "out_of_corpus",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .corpus import (
        PackedData,
        blocks_tensor,
        heldout_documents,
        is_heldout,
        load_documents,
        pack_documents,
        prepare_data,
        text_column_of,
    )
    from .heldout import EvaluationSet, python_docs_documents, sample_blocks
    from .out_of_corpus import out_of_corpus_set
    from .sources import DataError, embedded_corpus, embedded_corpus_files, load_text_dataset, stdlib_directory
