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


def short_documents(folder: Path, count: int = 1500) -> str:
    """A folder of `count` short text files, each a document of 3 to 40 bytes, so that nearly
    every window of 32 byte tokens holds a document boundary (document masking's tests)."""
    import random

    rng = random.Random(0)
    words = ["def", "return", "self", "import", "for", "in", "x", "=", "(", ")", ":", "1"]
    for i in range(count):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 10)))
        (folder / f"{i:04d}.txt").write_text(text[: rng.randint(3, 40)])
    return str(folder)
