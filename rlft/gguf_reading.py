"""Reading a GGUF file once, fast, for :func:`rlft.models.convert_gguf`.

transformers' GGUF loaders (config, tokenizer, weights) each open the file with
``gguf.GGUFReader``, which walks the metadata one element at a time through ``np.memmap``
slices: for a 150k-token vocabulary, tens of seconds per opening. Mapping tensor names, they
rebuild gguf's name table once per submodule (~10 s for a 0.5B model). For the duration of a
conversion, :func:`gguf_loading_shortcuts` hands them instead:

* one :class:`MappedGGUFReader`, parsed once: the same fields and tensors as ``GGUFReader``
  (same parts, dtypes and shapes), cut out of a plain ``ndarray`` view of the same memory map;
* a memoised ``gguf.get_tensor_name_map``.

Nothing here changes what transformers computes from the file, only how fast it gets there.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType


class MappedGGUFReader(GGUFReader):
    """``gguf.GGUFReader`` with the same result, faster.

    ``np.memmap`` runs Python hooks on every slice it hands out; the reader slices the file
    several times per metadata element, so it works on a plain ``ndarray`` view of the map instead
    (the map stays open through the view's base). Arrays of strings and of scalars are cut into
    their parts in one loop, not element by element through the generic path.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._flat

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._flat = mapped.view(np.ndarray)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list[int], list]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, count = GGUFValueType(raw_itype[0]), int(alen[0])
        # As the generic path: the element type is listed only when there is an element.
        types = [GGUFValueType.ARRAY] + [itype] * (count > 0)
        parts: list[np.ndarray] = [raw_itype, alen]
        offs = orig_offs + 12
        if itype == GGUFValueType.STRING:  # each element: its length (u64), then its bytes
            flat = self._flat
            length_type = np.dtype(np.uint64).newbyteorder(self.byte_order)
            for _ in range(count):
                length = flat[offs:offs + 8].view(length_type)
                end = offs + 8 + int(length[0])
                parts += (length, flat[offs + 8:end])
                offs = end
            return offs - orig_offs, parts, list(range(3, 2 * count + 2, 2)), types
        scalar_type = self.gguf_scalar_to_np.get(itype)
        if scalar_type is None:  # arrays of arrays
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, scalar_type, count)
        parts += list(values.reshape(count, 1))  # one 1-element view per element, as the generic path
        return 12 + int(values.nbytes), parts, list(range(2, 2 + count)), types


# ----------------------------------------------------------------------------- handing them on


@contextlib.contextmanager
def gguf_loading_shortcuts(path: str | os.PathLike, reader: GGUFReader) -> Iterator[None]:
    """While inside: ``gguf.GGUFReader(path)`` gives ``reader`` (parsed once, for the file at
    ``path``; other files open as usual) and ``gguf.get_tensor_name_map`` remembers its tables.
    transformers' GGUF code imports these from ``gguf`` when it runs, so it picks them up. Not
    thread-safe: meant for a conversion that holds its own lock."""
    import gguf

    path = Path(path).resolve()
    original_reader = gguf.GGUFReader

    def open_reader(file: Any, *args: Any, **kwargs: Any) -> GGUFReader:
        if not args and not kwargs and Path(file).resolve() == path:
            return reader
        return original_reader(file, *args, **kwargs)

    replaced = {"GGUFReader": open_reader, "get_tensor_name_map": functools.cache(gguf.get_tensor_name_map)}
    saved = {name: getattr(gguf, name) for name in replaced}
    for name, value in replaced.items():
        setattr(gguf, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(gguf, name, value)
