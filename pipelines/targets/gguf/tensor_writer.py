"""Writing a GGUF's tensor data as the converter streams it: slice by slice, each tensor in the header's order
or at its own offset (a k-quant is laid out in libllama's order but streamed in the plan's), with encoder
threads whose results are written in order."""

from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import gguf
import numpy as np

MAX_ENCODE_THREADS = 4  # beyond this the writer (one file, in order) is the bottleneck


class TensorWriter:
    """Writes one tensor's data slice by slice where GGUFWriter.write_tensor_data wants it whole: the same
    alignment padding before and after, the same bookkeeping (the writer's tensor infos, in order). With a
    `layout` (_Layout), at the tensor's own offset: tensors then come in any order."""

    def __init__(self, writer: gguf.GGUFWriter, out: Any, layout: Layout | None = None):
        self.writer = writer
        if layout is not None:
            file_id, offset, self.nbytes = layout.where[out.name]
            self.fout = writer.fout[file_id]
            self.fout.seek(offset)
        else:
            file_id = next(i for i, infos in enumerate(writer.tensors) if infos)
            first = next(iter(writer.tensors[file_id]))
            if first != out.name:
                raise RuntimeError(f"GGUF tensor data out of order: writing {out.name}, header expects {first}")
            self.fout = writer.fout[file_id]
            self.nbytes = writer.tensors[file_id].pop(first).nbytes
            writer.write_padding(self.fout, self.fout.tell())
        self.written = 0

    def write(self, encoded: np.ndarray) -> None:
        encoded.tofile(self.fout)
        self.written += encoded.nbytes

    def close(self) -> None:
        if self.written != self.nbytes:
            raise RuntimeError(f"GGUF tensor data is {self.written} bytes, its header says {self.nbytes}")
        self.writer.write_padding(self.fout, self.nbytes)
        self.writer.state = gguf.gguf_writer.WriterState.WEIGHTS


class Layout:
    """Each tensor's (shard, offset, size) in the data sections, taken right after the tensor infos are written
    (the data section's leading padding is written here)."""

    def __init__(self, writer: gguf.GGUFWriter):
        self.where: dict[str, tuple[int, int, int]] = {}
        for file_id, (fout, infos) in enumerate(zip(writer.fout, writer.tensors)):
            writer.write_padding(fout, fout.tell())
            offset = fout.tell()
            for name, info in infos.items():
                self.where[name] = (file_id, offset, info.nbytes)
                offset += gguf.GGUFWriter.ggml_pad(info.nbytes, writer.data_alignment)


def llama_cpp_order(name: str) -> tuple[int, str]:
    """The order libllama's quantizer writes tensors in (its loader's map): tensors outside blocks first, then
    block by block, by name within each."""
    m = re.match(r"blk\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)


def encode_threads() -> int:
    """Threads that widen and encode slices while the main thread writes (numpy releases the GIL in both)."""
    return max(1, min(MAX_ENCODE_THREADS, os.cpu_count() or 1))


def in_order(jobs: Iterable[Callable[[], Any]], done: Callable[[Any], None], threads: int) -> None:
    """Run `jobs` on `threads` threads and hand their results to `done` in order. At most threads + 1 results
    are in flight, so memory grows by a few slices, never by a tensor; the first failure stops the rest."""
    if threads <= 1:
        for job in jobs:
            done(job())
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="gguf-encode") as pool:
        pending: deque[Future] = deque()
        try:
            for job in jobs:
                pending.append(pool.submit(job))
                if len(pending) > threads:
                    done(pending.popleft().result())
            while pending:
                done(pending.popleft().result())
        finally:
            for f in pending:
                f.cancel()
