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
