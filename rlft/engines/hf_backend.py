"""HF ``generate``'s record (:data:`HF`): the engine that runs in the rank's own process on any
device, takes no settings of its own and is usable everywhere, so ``auto`` falls back to it.
The engine itself is :class:`rlft.engines.hf_engine.HFEngine`; the record's defaults
(:class:`rlft.engines.records.Backend`) describe it."""

from __future__ import annotations

from rlft.engines.records import Backend, register_backend

HF = register_backend(Backend("hf", engine="rlft.engines.hf_engine:HFEngine", label="HF generate"))
