"""Which bytes of a storage the tensors that view it reach.

A view keeps its whole storage alive. Whether that pins memory depends on what else is in the
storage: a key that is a view of `mixed_qkv` pins the q third, but a key and a value that are the
two halves of one stacked (2, B, H, T, hd) buffer pin nothing. P3 and the memory checks ask the
same question: do the cache's own tensors account for every byte of the storages they live in?
"""

from __future__ import annotations

import torch


def storage_key(t: torch.Tensor) -> int:
    """The identity of a tensor's storage (its StorageImpl): equal for every view of it."""
    return t.untyped_storage()._cdata


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes of its storage between the first and the last element a tensor reaches."""
    s = t.element_size()
    start = t.storage_offset() * s
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
    return start, start + (last + 1) * s


def covered_bytes(nbytes: int, tensors: list[torch.Tensor]) -> int:
    """How many of a storage's `nbytes` the given views of it reach.

    Dense views (every byte of their span is theirs, whatever their strides: a transpose or a
    slice along the first dimension) with disjoint spans add their sizes; anything else (views
    with gaps, such as a (B, H, T, hd) slice of a (B, T, 3D) buffer, or overlapping views) is
    counted exactly with a byte mask of the storage."""
    spans = sorted(byte_span(t) for t in tensors)
    dense = all(end - start == t.numel() * t.element_size() for t, (start, end) in zip(tensors, map(byte_span, tensors)))
    disjoint = all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    if dense and disjoint:
        return min(nbytes, sum(end - start for start, end in spans))
    mask = torch.zeros(nbytes, dtype=torch.bool)
    for t in tensors:
        s = t.element_size()
        mask.as_strided((*t.shape, s), (*(x * s for x in t.stride()), 1), t.storage_offset() * s).fill_(True)
    return int(mask.sum())
