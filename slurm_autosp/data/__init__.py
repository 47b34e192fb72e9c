"""Training data: samples by global index (synthetic, token files, prepared datasets), the
token file format, and `python -m slurm_autosp data prepare`, which makes a prepared dataset
from text with a Hugging Face tokenizer."""

from slurm_autosp.data.sources import (
    BlendedSource,
    MicroBatch,
    Sample,
    SampleSource,
    ShuffledSource,
    SyntheticSource,
    TokenFileSource,
    build_source,
    check_token_file,
    data_identity,
    eval_data_path,
    micro_batch,
    open_eval_source,
    open_tokens,
    prepared_tokenizer,
)
from slurm_autosp.data.token_file import (
    TOKEN_FILE_MAGIC,
    TokenFileWriter,
    read_token_file,
    write_token_file,
)

__all__ = [
    "BlendedSource",
    "TOKEN_FILE_MAGIC",
    "MicroBatch",
    "Sample",
    "SampleSource",
    "ShuffledSource",
    "SyntheticSource",
    "TokenFileSource",
    "TokenFileWriter",
    "build_source",
    "check_token_file",
    "data_identity",
    "eval_data_path",
    "micro_batch",
    "open_eval_source",
    "open_tokens",
    "prepared_tokenizer",
    "read_token_file",
    "write_token_file",
]
