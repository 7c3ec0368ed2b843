"""Datasets (embedded stdlib corpus, text, ``.bin`` token files) and resumable DP samplers."""

from stalwart.data.blend import BlendedDataset, SampleSource, parse_data_blend
from stalwart.data.corpus import (
    DEFAULT_CORPUS_MAX_BYTES,
    EXPECTED_CORPUS_SHA256,
    Corpus,
    build_corpus,
    corpus_sha256,
    default_cache_dir,
    expected_corpus_sha256,
    load_corpus,
)
from stalwart.data.datasets import TokenDataset, build_datasets, check_vocab, load_tokens
from stalwart.data.loader import WorkerMicroBatchIterator
from stalwart.data.sampler import (
    MicroBatchIterator,
    calculate_num_microbatches,
    make_eval_iterator,
)

__all__ = [
    "DEFAULT_CORPUS_MAX_BYTES",
    "EXPECTED_CORPUS_SHA256",
    "BlendedDataset",
    "Corpus",
    "MicroBatchIterator",
    "SampleSource",
    "TokenDataset",
    "WorkerMicroBatchIterator",
    "build_corpus",
    "build_datasets",
    "calculate_num_microbatches",
    "check_vocab",
    "corpus_sha256",
    "default_cache_dir",
    "expected_corpus_sha256",
    "load_corpus",
    "load_tokens",
    "make_eval_iterator",
    "parse_data_blend",
]
