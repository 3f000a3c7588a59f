"""``Data``, the config group of where tokens come from and how they become rows
(re-exported by :mod:`boost_jax.config` with the other three groups)."""

from __future__ import annotations

import dataclasses

from boost_jax.config_fields import FREE, MATCH, NOTE, Derived
from boost_jax.config_fields import check as _check
from boost_jax.config_fields import config_field as _field

#: ``Data.packing``: data/loader.py, data/packing.py
PACKINGS = ("concat", "document", "pad")


@dataclasses.dataclass(frozen=True)
class Data(metaclass=Derived):
    """Where tokens come from.

    ``path`` is a directory written by ``python -m boost_jax.data.prepare`` or
    ``bundled:<name>`` for a corpus shipped with the package (prepared into ``cache_dir`` on
    first use with ``tokenizer``).
    """

    path: str = _field("bundled:shakespeare", "a directory written by boost_jax.data.prepare, "
                       "or bundled:<name> for a corpus shipped with the package", NOTE)
    tokenizer: str = _field("bpe:4096", "bundled corpora: bpe:<vocab> | llama32k | "
                            "spm:<file>", MATCH)
    eval_fraction: float = _field(0.02, "bundled corpora: share of documents held out", NOTE)
    worker_count: int = _field(0, "grain worker processes (0: in-process)", MATCH)
    device_prefetch: int = _field(2, "global batches a background thread puts on the devices "
                                  "ahead of the step that takes them (0: each when its step "
                                  "starts)", FREE)
    cache_dir: str | None = _field(None, "where bundled corpora are prepared (None: "
                                   "$BOOST_JAX_CACHE or ~/.cache/boost_jax)", FREE)
    packing: str = _field("concat", "concat (windows over concatenated documents) | document "
                          "(whole documents packed into rows, attention masked to each) | pad "
                          "(one document per row, cut to Train.seq_len and padded: the "
                          "low-rank papers' rows)", MATCH)
    packing_bins: int = _field(64, "document packing: rows packed together (the global batch "
                               "is cut into groups of this many)", MATCH)
    max_segments: int | None = _field(None, "document packing: at most this many documents "
                                      "per row (None: no bound); cuDNN's packed attention "
                                      "needs it", MATCH)

    @property
    def packed(self) -> bool:
        """Whether rows carry ``segment_ids`` and ``positions`` (models/batch.py): documents
        packed, or one padded document per row."""
        return self.packing != "concat"

    @property
    def segment_bound(self) -> int | None:
        """Documents per row at most (``None``: no bound): ``max_segments`` when packing
        documents, 1 for padded rows."""
        return 1 if self.packing == "pad" else self.max_segments

    def __post_init__(self):
        _check(self.packing_bins >= 1, f"Data.packing_bins={self.packing_bins} must be >= 1")
        _check(self.max_segments is None or self.max_segments >= 1,
               f"Data.max_segments={self.max_segments} must be >= 1 or None")
        _check(self.packing in PACKINGS,
               f"Data.packing={self.packing!r} must be one of {', '.join(PACKINGS)}")
        _check(0.0 < self.eval_fraction < 0.5,
               f"Data.eval_fraction={self.eval_fraction} must be in (0, 0.5)")
        for name in ("worker_count", "device_prefetch"):
            _check(getattr(self, name) >= 0, f"Data.{name}={getattr(self, name)} must be >= 0")
