"""`python -m engine.model.prepare MODEL`: resolve a model before any node loads it (a GGUF
file converted once into the cache, under its lock) and print the folder the nodes will read.

pd-serve runs it before it starts the nodes: they then only read the converted folder, and a
model that cannot be read fails there, in seconds, with one line, before any node starts.
"""

from __future__ import annotations

import logging
import sys

from engine.model.sources import resolve_model_source


def main(argv: list[str] | None = None) -> int:
    """Exit 0 and print the model's folder (its name for a synthetic model); exit 2 with a
    one-line reason when it cannot be read."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m engine.model.prepare MODEL", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the conversion's progress
    try:
        source = resolve_model_source(argv[0])
    except (OSError, ValueError) as error:
        print(error, file=sys.stderr)
        return 2
    print(source.hf_dir or source.name, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
