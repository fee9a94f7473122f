"""Megatron-LM indexed datasets (a `.idx` index and a `.bin` of tokens), NumPy only.

`MegatronDataset(prefix)` is a map-style dataset whose item i is the token ids of the i-th
non-empty document, the order in which wlb's Megatron length source (`data.source =
"megatron"`) numbers documents: a plan's document id `d` is item `d % len(dataset)`.
`write_megatron_dataset(prefix, documents)` writes such a pair (one sequence per document).
"""

import os

import numpy as np

from ._wlb import read_megatron_idx

# Megatron-LM's DType codes (megatron/core/datasets/indexed_dataset.py).
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
MAGIC = b"MMIDIDX\x00\x00"
_HEADER = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count


def _prefix(path):
    path = os.fspath(path)
    for ext in (".idx", ".bin"):
        if path.endswith(ext):
            return path[: -len(ext)]
    return path


class MegatronDataset:
    """Documents of a Megatron `.idx`/`.bin` pair; item i = tokens of non-empty document i.

    The index is validated by the C++ reader (ValueError naming the byte offset, as the
    `wlb` command reports it); the `.bin` is memory-mapped, so an item is a view, not a copy.
    """

    def __init__(self, prefix):
        self.prefix = _prefix(prefix)
        idx, binf = self.prefix + ".idx", self.prefix + ".bin"
        # validates; the lengths wlb packs (none: `data prepare`'s empty validation split)
        self.lengths = read_megatron_idx(idx, allow_empty=True)
        raw = np.fromfile(idx, dtype=np.uint8)
        code = int(raw[17])
        nseq, ndoc = (int(x) for x in raw[18:_HEADER].view("<u8"))
        self.dtype = np.dtype(DTYPES[code])
        sizes = raw[_HEADER:_HEADER + 4 * nseq].view("<i4").astype(np.int64)
        pointers = raw[_HEADER + 4 * nseq:_HEADER + 12 * nseq].view("<i8")
        doc_idx = raw[_HEADER + 12 * nseq:_HEADER + 12 * nseq + 8 * ndoc].view("<i8")
        csum = np.concatenate(([0], np.cumsum(sizes)))
        doc_len = csum[doc_idx[1:]] - csum[doc_idx[:-1]]
        keep = np.nonzero(doc_len > 0)[0]  # the reader skips empty documents
        self._first = doc_idx[keep]
        self._end = doc_idx[keep + 1]
        assert np.array_equal(doc_len[keep], self.lengths)
        self._sizes, self._pointers = sizes, pointers
        nbytes = os.path.getsize(binf)
        item = self.dtype.itemsize
        if nseq and int((pointers + sizes * item).max()) > nbytes:
            raise ValueError(f"{binf}: {nbytes} bytes, but {idx} points past its end")
        self._tokens = np.memmap(binf, dtype=self.dtype, mode="r") if nbytes else np.zeros(0, self.dtype)
        # sequences stored back to back: a document is one slice of the .bin
        self._contiguous = bool(np.all(pointers[1:] == pointers[:-1] + sizes[:-1] * item)) if nseq > 1 else True

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        if not -len(self) <= i < len(self):
            raise IndexError(f"document {i} out of range ({len(self)} documents)")
        s0, s1 = int(self._first[i]), int(self._end[i])
        start = int(self._pointers[s0]) // self.dtype.itemsize
        if self._contiguous:
            return self._tokens[start:start + int(self.lengths[i])]
        parts = []
        for s in range(s0, s1):  # one slice per sequence of the document
            b = int(self._pointers[s]) // self.dtype.itemsize
            parts.append(self._tokens[b:b + int(self._sizes[s])])
        return np.concatenate(parts)


def write_megatron_dataset(prefix, documents, dtype=np.int32):
    """Write `documents` (sequences of token ids) as PREFIX.bin and PREFIX.idx, one sequence
    per document; both files are written under temporary names and renamed."""
    prefix = _prefix(prefix)
    dt = np.dtype(dtype)
    if dt not in CODES:
        raise ValueError(f"dtype: {dt} has no Megatron code (valid: {', '.join(str(np.dtype(v)) for v in DTYPES.values())})")
    docs = []
    for i, d in enumerate(documents):
        a = np.asarray(d).ravel()
        if a.size and not (np.issubdtype(a.dtype, np.integer) or a.dtype == dt):
            raise ValueError(f"documents[{i}]: token ids must be integers, not {a.dtype}")
        if a.size and np.issubdtype(a.dtype, np.integer) and np.issubdtype(dt, np.integer) \
                and not np.can_cast(a.dtype, dt):
            info = np.iinfo(dt)  # ids outside the dtype would wrap silently in astype
            if a.min() < info.min or a.max() > info.max:
                raise ValueError(f"documents[{i}]: token ids span [{a.min()}, {a.max()}], outside {dt}'s "
                                 f"[{info.min}, {info.max}]")
        docs.append(a.astype(dt))
    sizes = np.array([len(d) for d in docs], dtype=np.int64)
    if len(docs) == 0 or sizes.max() > np.iinfo(np.int32).max:
        raise ValueError("documents: need at least one document, each under 2^31 tokens")
    pointers = np.concatenate(([0], np.cumsum(sizes[:-1] * dt.itemsize))).astype("<i8")
    tmp_bin, tmp_idx = prefix + ".bin.tmp", prefix + ".idx.tmp"
    with open(tmp_bin, "wb") as f:
        for d in docs:
            f.write(d.tobytes())
    with open(tmp_idx, "wb") as f:
        f.write(MAGIC)
        f.write(np.array([1], "<u8").tobytes())
        f.write(np.array([CODES[dt]], "u1").tobytes())
        f.write(np.array([len(docs), len(docs) + 1], "<u8").tobytes())
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(len(docs) + 1, dtype="<i8").tobytes())
    os.replace(tmp_bin, prefix + ".bin")
    os.replace(tmp_idx, prefix + ".idx")
    return prefix
