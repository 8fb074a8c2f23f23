"""`python -m plait ...`, which is also how torchrun starts plait: `torchrun ... -m plait train`."""

from plait.cli import main

if __name__ == "__main__":
    main()
