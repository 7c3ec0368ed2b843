"""Datasets (embedded stdlib corpus, text, ``.bin`` token files) and resumable DP samplers."""

from stalwart.data.blend import BlendedDataset, SampleSource, parse_data_blend
from stalwart.data.corpus import (
    Corpus,
    build_corpus,
    corpus_sha256,
    expected_corpus_sha256,
    load_corpus,
)
from stalwart.data.datasets import TokenDataset, build_datasets, load_tokens
from stalwart.data.loader import WorkerMicroBatchIterator
from stalwart.data.sampler import (
    MicroBatchIterator,
    calculate_num_microbatches,
    make_eval_iterator,
)

__all__ = [
    "BlendedDataset",
    "Corpus",
    "MicroBatchIterator",
    "SampleSource",
    "TokenDataset",
    "WorkerMicroBatchIterator",
    "build_corpus",
    "build_datasets",
    "calculate_num_microbatches",
    "corpus_sha256",
    "expected_corpus_sha256",
    "load_corpus",
    "load_tokens",
    "make_eval_iterator",
    "parse_data_blend",
]
