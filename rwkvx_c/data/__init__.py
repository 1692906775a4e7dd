"""The data layer: where documents come from, the formats they are read in,
the token cache, the one corpus pipeline (load_corpus) for every
tokenizer, batch sampling, and the tokenizers. Imports the model and run
layers, rwkvx_c.util, rwkvx_c.errors and the binding, never a layer above."""
from rwkvx_c.data.cache import default_cache_dir
from rwkvx_c.data.pipeline import Corpus, load_corpus
from rwkvx_c.data.sampler import BatchSampler, eval_windows
from rwkvx_c.data.sources import is_val_file, source_files, stdlib_files
from rwkvx_c.data.tokenizers import ByteTokenizer, Tokenizer
from rwkvx_c.errors import DataError

__all__ = ["load_corpus", "Corpus", "DataError", "BatchSampler", "eval_windows",
           "ByteTokenizer", "Tokenizer", "default_cache_dir", "stdlib_files", "source_files",
           "is_val_file"]
