"""How a streamed model's units take memory and give it back.

glibc is told to return every large freed block to the kernel (`return_freed_memory`), so a streamed model's
resident set stays at one unit; after a resident reference the heap is trimmed (`trim_heap`).

Within a streamed model, a dropped unit's fp32 buffers are handed to the next unit that reads tensors of the
same shapes (`BufferPool`). A streamed pass reads every unit again (a reference's logits pass, then a pass per
greedy token), and memory fresh from the kernel costs a page fault and the kernel's zeroing for every 4 KiB
page: several times the widening itself (bf16 widened into fresh memory at 2.3-2.9 GB/s of fp32 here, into
memory already mapped at 18 GB/s). Decoder layers share their shapes, so a layer's
buffers serve the next layer (and an untied lm_head's the next pass's embedding), and each unit's bytes are
written into memory already mapped.

Only a parameter whose tensor is the very buffer its read was given comes back (the streamed model keeps
that account): a buffer a weight rule turned into another tensor (a permutation, a concatenation) has been
freed with its last reference, and what a model's own reader or transform made is never taken. Before a unit
is read, the spares it has no use for are let go, and a read the spares cannot serve lets them all go before it
allocates, so the pool never adds to the peak of one unit resident.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def return_freed_memory() -> None:
    """Make glibc give freed blocks of 1 MiB and more straight back to the kernel. By default its mmap
    threshold rises to 32 MiB after the first large free, so a layer's 4-32 MiB weight matrices land on
    the heap, and the heap does not shrink between layers: streamed, the process would still grow to
    the size of the model."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (a fixed value also stops the dynamic adjustment)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def trim_heap() -> None:
    """Hand the heap's free pages back to the kernel (after an in-process reference: the build goes on
    to run an engine child, and the fp32 weights it no longer holds should not stay counted)."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class BufferPool:
    """A streamed model's spare fp32 buffers, by shape (see the module's docstring)."""

    def __init__(self) -> None:
        self._spare: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self.allocated = self.reused = 0  # reads given new memory, reads given a spare

    def keep_only(self, shapes: list[tuple[int, ...]]) -> None:
        """Let go of the spares the coming unit has no use for (its tensors' `shapes`, with repeats)."""
        wanted = Counter(shapes)
        for shape in list(self._spare):
            del self._spare[shape][wanted.get(shape, 0):]
            if not self._spare[shape]:
                del self._spare[shape]

    def take(self, shape) -> torch.Tensor:
        """A float32 tensor of `shape` with arbitrary contents: a spare when there is one, else a new one."""
        import torch

        spares = self._spare.get(tuple(shape))
        if spares:
            self.reused += 1
            return spares.pop()
        self._spare.clear()  # read in another shape than the unit's parameters (a stack of experts, a fused matrix)
        self.allocated += 1
        return torch.empty(tuple(shape), dtype=torch.float32)

    def give(self, tensor: torch.Tensor) -> None:
        """A buffer `take` handed out, no longer used by anything (a dropped parameter's own memory): a spare."""
        self._spare.setdefault(tuple(tensor.shape), []).append(tensor)

    def clear(self) -> None:
        self._spare.clear()
