"""libllama's log in a child process: its error lines kept, so a refusal says why, not only that it happened.

llama-cpp-python's `Llama(verbose=False)` silences libllama, and a model it cannot load surfaces as "Failed to
load model from file", whatever the reason; libllama logged the reason at error level just before. Runs only in
children (pipelines.process.isolation): the callback must outlive every call into libllama, so it is kept here.
"""

from __future__ import annotations

import ctypes

GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT = 4, 5
_KEEP: list = []  # the installed callback: ctypes must not collect it while libllama holds its pointer


def capture_errors() -> list[str]:
    """Route libllama's log to a list of its error lines (stripped; a continued line joins its start) and
    return that list; every other line is dropped."""
    import llama_cpp

    errors: list[str] = []
    last = [0]

    @llama_cpp.llama_log_callback
    def collect(level: int, text: bytes, _user_data) -> None:
        level = last[0] if level == GGML_LOG_LEVEL_CONT else level
        continued = level == last[0] and errors and not errors[-1].endswith("\n")
        last[0] = level
        if level == GGML_LOG_LEVEL_ERROR:
            msg = text.decode("utf-8", "replace")
            if continued:
                errors[-1] += msg
            else:
                errors.append(msg)

    llama_cpp.llama_log_set(collect, ctypes.c_void_p(0))
    _KEEP[:] = [collect]
    return errors


def reason(errors: list[str]) -> str:
    """The most specific error line: libllama logs the cause first, then that loading failed."""
    lines = [e.strip() for e in errors if e.strip()]
    specific = [line for line in lines if "error loading model" in line]
    return (specific or lines or ["no error line logged"])[0][:300]


__all__ = ["capture_errors", "reason"]
