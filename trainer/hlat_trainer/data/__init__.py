"""Data for the trainer: the online packing loader of HLAT (paper section 3.3) and tokenizers.

`PackedLoader` reads Arrow files (memory-mapped), shuffles documents per epoch, gives each
data-parallel rank its own stream, tokenizes in a background thread and packs documents joined
by EOS into fixed-length rows; `state_dict`/`load_state_dict` resume at exactly the next token.
`load_tokenizer` returns a HF `tokenizers` JSON tokenizer or the built-in byte-level one.
`hlat-data sample` (see `sample`) writes a small dataset and tokenizer from the Python stdlib.
"""

from hlat_trainer.data.arrow import ArrowSource, resolve_paths
from hlat_trainer.data.packing import PackedLoader, Position
from hlat_trainer.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ArrowSource",
    "ByteTokenizer",
    "HFTokenizer",
    "PackedLoader",
    "Position",
    "Tokenizer",
    "load_tokenizer",
    "resolve_paths",
]
