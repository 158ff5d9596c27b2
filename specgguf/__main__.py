"""``python -m specgguf``: the same entry point as the ``specgguf`` console script."""

from specgguf.cli import main

main()
