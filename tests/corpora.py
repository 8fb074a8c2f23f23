"""Small corpora the data tests share."""

from pathlib import Path


def word_level_tokenizer(path: Path, size: int) -> Path:
    """A tokenizer.json of `size` words "w0" ... and an end-of-text token after them: a vocabulary
    as large as a test needs (uint32 ids above 65,535) without training one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(size)} | {"<|endoftext|>": size}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path
