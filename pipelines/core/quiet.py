"""Keep third-party libraries from writing around hive-aot's own one-line messages."""

from __future__ import annotations

import sys


def quiet_transformers() -> None:
    """transformers' own warnings (and, off a terminal, its progress bars) would surround hive-aot's one
    error line and fill build logs; what matters is reported by hive-aot itself."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()


def quiet_gguf() -> None:
    """gguf-py's SpecialVocab warns through the `gguf` logger about tokenizer templates it parses crudely
    ("Unknown separator token ... in TemplateProcessing<pair>"); with no handler configured, Python's last-resort
    handler printed those around a build's one summary line. The converter reads the tokens it writes itself."""
    import logging

    logging.getLogger("gguf").setLevel(logging.ERROR)
