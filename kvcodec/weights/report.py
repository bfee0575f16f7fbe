"""What a compressed-in-memory model holds: one row per compressed weight (tied weights once)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class WeightRow:
    name: str  # the parameter's name (the first module that holds it)
    aliases: tuple[str, ...]  # other parameter names of the same tensor (tied weights)
    dtype: str
    shape: tuple[int, ...]
    original_nbytes: int  # the dense tensor
    nbytes: int  # the blob held

    @property
    def ratio(self) -> float:
        return self.original_nbytes / self.nbytes if self.nbytes else float("inf")


@dataclass(frozen=True)
class WeightReport:
    device: str  # where the blobs are held and decoded
    rows: list[WeightRow] = field(default_factory=list)
    scratch_nbytes: int = 0  # the reused decode buffer (CPU); on CUDA the allocator's, up to two weights

    @property
    def nbytes(self) -> int:
        """Bytes of compressed weights held."""
        return sum(r.nbytes for r in self.rows)

    @property
    def original_nbytes(self) -> int:
        """Bytes the same weights take uncompressed."""
        return sum(r.original_nbytes for r in self.rows)

    @property
    def ratio(self) -> float:
        return self.original_nbytes / self.nbytes if self.nbytes else float("inf")

    def to_dict(self) -> dict:
        return {"device": self.device, "nbytes": self.nbytes, "original_nbytes": self.original_nbytes,
                "ratio": self.ratio, "scratch_nbytes": self.scratch_nbytes,
                "rows": [{**asdict(r), "ratio": r.ratio} for r in self.rows]}
