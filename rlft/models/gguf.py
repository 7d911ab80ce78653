"""Reading a GGUF file once, fast, for :func:`rlft.models.loading.convert_gguf`.

transformers' GGUF loaders (config, tokenizer, weights) each open the file with
``gguf.GGUFReader``, which walks the metadata one element at a time through ``np.memmap``
slices: for a 150k-token vocabulary, tens of seconds per opening. Mapping tensor names, they
rebuild gguf's name table once per submodule (~10 s for a 0.5B model); and they dequantise each
tensor with gguf's numpy code, 16 rows at a time on one core. For the duration of a conversion,
:func:`gguf_loading_shortcuts` hands them instead:

* one :class:`MappedGGUFReader`, parsed once: the same fields and tensors as ``GGUFReader``
  (same parts, dtypes and shapes), cut out of a plain ``ndarray`` view of the same memory map;
* a memoised ``gguf.get_tensor_name_map``;
* :func:`dequantize`: ``gguf.dequantize``'s values, bit for bit, computed in cache-sized chunks on
  every core, with leaner kernels for the 32-value block formats.

Nothing here changes what transformers computes from the file, only how fast it gets there.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf import quants as gguf_quants


# The gguf releases whose reader internals (`_get_field_parts`, `_get`, the quant classes) the
# shortcuts below were checked against, bit for bit, by tests/test_models.py.
CHECKED_GGUF_VERSIONS = ("0.19.",)


@contextlib.contextmanager
def conversion_reading(path: str | os.PathLike) -> Iterator[GGUFReader]:
    """The file's reader for a conversion, parsed once. With a gguf release the shortcuts were checked
    against, transformers' GGUF loading takes them (:func:`gguf_loading_shortcuts`) while inside;
    with another, gguf's own reader and code serve, slower, and a log line says why."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("gguf")
    except PackageNotFoundError:
        installed = "(unknown)"
    if installed.startswith(CHECKED_GGUF_VERSIONS):
        reader = MappedGGUFReader(path)
        with gguf_loading_shortcuts(path, reader):
            yield reader
    else:
        logging.getLogger("rlft").info("gguf %s is not a release rlft's fast GGUF reading was checked against: "
                                       "reading it the slower way", installed)
        yield GGUFReader(path)


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


# ----------------------------------------------------------------------------- dequantisation

# Values per chunk: 1 MB of float32 output, so each step's temporaries stay in cache.
_CHUNK_VALUES = 1 << 18


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType, pool: Executor | None = None) -> np.ndarray:
    """``gguf.dequantize(data, qtype)``, bit for bit: the same float32 array, faster.

    Plain float types go to gguf as they are. Block formats are split into chunks of whole blocks,
    run on ``pool`` when given (numpy's element-wise loops release the GIL), each by a kernel of
    :data:`_KERNELS` or else by gguf's own per-block code. A block's values depend on that block
    alone, so chunking cannot change them, and the kernels do gguf's float operations, in gguf's
    order, on the same operands.
    """
    quant = gguf_quants._type_traits.get(qtype)
    if (quant is None or not isinstance(data, np.ndarray)
            or qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)):
        return gguf_quants.dequantize(data, qtype)
    quant.init_grid()  # the lattice formats' lookup table, built once (gguf does this per call too)
    blocks = data.view(np.uint8).reshape(-1, quant.type_size)
    out = np.empty((blocks.shape[0], quant.block_size), dtype=np.float32)
    kernel = _KERNELS.get(qtype) if sys.byteorder == "little" else None
    kernel = kernel or quant.dequantize_blocks
    step = max(1, _CHUNK_VALUES // quant.block_size)

    def run(start: int) -> None:
        out[start:start + step] = kernel(blocks[start:start + step])

    starts = range(0, blocks.shape[0], step)
    for _ in (pool.map(run, starts) if pool is not None and len(starts) > 1 else map(run, starts)):
        pass
    return out.reshape(gguf_quants.quant_shape_from_byte_shape(data.shape, qtype))


# The 32-value block formats: an fp16 scale d (and for the _1 formats an fp16 minimum m), for the
# 5-bit ones a 32-bit plane of fifth bits, then the quants: 32 int8 (Q8_0) or 16 bytes of nibbles,
# low nibbles being values 0-15 and high ones values 16-31 (ggml's block_q8_0, block_q4_0, ...).


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of each block, as ``(n, 1)`` float32."""
    return blocks[:, at:at + 2].view(np.float16).astype(np.float32)


def _unpack(blocks: np.ndarray, quants_at: int, fifth_bits_at: int | None = None) -> np.ndarray:
    """The 32 unsigned quants of each block, ``(n, 32)`` uint8: nibbles, plus the fifth bit (bit i
    of the little-endian u32 belongs to value i) when the format has one."""
    nibbles = blocks[:, quants_at:quants_at + 16]
    q = np.empty((blocks.shape[0], 32), dtype=np.uint8)
    np.bitwise_and(nibbles, 0x0F, out=q[:, :16])
    np.right_shift(nibbles, 4, out=q[:, 16:])
    if fifth_bits_at is not None:
        high = np.unpackbits(blocks[:, fifth_bits_at:fifth_bits_at + 4], axis=1, bitorder="little")
        np.left_shift(high, 4, out=high)
        np.bitwise_or(q, high, out=q)
    return q


def _centred(q: np.ndarray, offset: int) -> np.ndarray:
    """``q - offset`` as int8 (gguf's signed quants)."""
    return np.subtract(q.view(np.int8), np.int8(offset), dtype=np.int8)


# Each computes what gguf's dequantize_blocks does, operand for operand.


def _q8_0(blocks: np.ndarray) -> np.ndarray:  # x * d
    return np.multiply(blocks[:, 2:].view(np.int8), _half(blocks, 0), dtype=np.float32)


def _q4_0(blocks: np.ndarray) -> np.ndarray:  # d * (q - 8)
    return np.multiply(_half(blocks, 0), _centred(_unpack(blocks, 2), 8), dtype=np.float32)


def _q5_0(blocks: np.ndarray) -> np.ndarray:  # d * (q - 16)
    return np.multiply(_half(blocks, 0), _centred(_unpack(blocks, 6, 2), 16), dtype=np.float32)


def _q4_1(blocks: np.ndarray) -> np.ndarray:  # (d * q) + m
    values = np.multiply(_half(blocks, 0), _unpack(blocks, 4), dtype=np.float32)
    return np.add(values, _half(blocks, 2), out=values)


def _q5_1(blocks: np.ndarray) -> np.ndarray:  # (d * q) + m
    values = np.multiply(_half(blocks, 0), _unpack(blocks, 8, 4), dtype=np.float32)
    return np.add(values, _half(blocks, 2), out=values)


_KERNELS = {GGMLQuantizationType.Q8_0: _q8_0, GGMLQuantizationType.Q4_0: _q4_0, GGMLQuantizationType.Q5_0: _q5_0,
            GGMLQuantizationType.Q4_1: _q4_1, GGMLQuantizationType.Q5_1: _q5_1}


# ----------------------------------------------------------------------------- handing them on


@contextlib.contextmanager
def gguf_loading_shortcuts(path: str | os.PathLike, reader: GGUFReader) -> Iterator[None]:
    """While inside: ``gguf.GGUFReader(path)`` gives ``reader`` (parsed once, for the file at
    ``path``; other files open as usual), ``gguf.dequantize`` is :func:`dequantize`, and
    ``gguf.get_tensor_name_map`` remembers its tables. transformers' GGUF code imports these from
    ``gguf`` when it runs, so it picks them up. Not thread-safe: meant for a conversion that holds
    its own lock."""
    import gguf

    path = Path(path).resolve()
    original_reader = gguf.GGUFReader

    def open_reader(file: Any, *args: Any, **kwargs: Any) -> GGUFReader:
        if not args and not kwargs and Path(file).resolve() == path:
            return reader
        return original_reader(file, *args, **kwargs)

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=cores, thread_name_prefix="dequantize") as pool:
        replaced = {"GGUFReader": open_reader, "dequantize": functools.partial(dequantize, pool=pool),
                    "get_tensor_name_map": functools.cache(gguf.get_tensor_name_map)}
        saved = {name: getattr(gguf, name) for name in replaced}
        for name, value in replaced.items():
            setattr(gguf, name, value)
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(gguf, name, value)
