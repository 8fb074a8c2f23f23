"""`python -m plait ...`, which is also how torchrun starts plait: `torchrun ... -m plait train`."""

from plait.cli import console

if __name__ == "__main__":
    console()
