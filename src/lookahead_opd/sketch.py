"""How straight is the path? The cosine between successive search directions, from a sketch.

At each search the extrapolator compares this window's direction ``Δ_n`` with the previous
one's: ``secant_cosine = cos(Δ_n, Δ_{n−1})`` (near 1 on a straight path, near 0 on a random
walk) and ``norm_ratio = ‖Δ_n‖/‖Δ_{n−1}‖``. Keeping ``Δ_{n−1}`` would cost a second copy of the
weights, so only a CountSketch of it is kept: element ``j`` of parameter ``i`` goes, with a
random sign, into one of ``k`` buckets, both chosen by a fixed hash of ``(i, j)`` with ``j`` the
element's index in the *global* (unsharded) tensor. A rank holding an FSDP shard therefore
sketches its part of the same vector, and one all-reduce (SUM) gives every rank the same sketch;
replicated tensors are split between ranks chunk by chunk, so each element is counted once.

Accuracy: to first order the estimate ``<S_n, S_{n−1}> / (‖S_n‖‖S_{n−1}‖)`` has standard
deviation at most ``(1 − c²)/√k ≤ 1/√k`` about the exact cosine ``c`` (CountSketch's covariances
are those of a Gaussian projection minus a non-negative term), so ``|ĉ − c| ≤ Z/√k`` except with
probability about 6·10⁻⁵ (``Z = 4``). ``k = max(1% of the elements, (Z/ACCURACY)²)``, which
makes that bound ``ACCURACY = 0.05`` or better. The norms behind ``norm_ratio`` are exact (one
extra sum of squares, reduced with the sketch).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from . import distributed
from .distributed import ShardLayout

__all__ = ["SecantSketch", "sketch_size", "cosine_tolerance", "ACCURACY", "Z"]

ACCURACY = 0.05  # the documented bound on |ĉ − c| at the smallest sketch
Z = 4.0  # standard deviations the bound allows
MIN_FRACTION = 0.01  # the sketch has at least 1% as many buckets as the direction has elements
_CHUNK = 1 << 18  # elements hashed at a time: bounds the int64 scratch to a few MiB

# splitmix64's constants (Steele, Lea & Flood 2014), as int64 (whose arithmetic wraps mod 2^64).
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
_LOW31 = (1 << 31) - 1


def sketch_size(numel: int) -> int:
    """Buckets for a direction of ``numel`` elements: ``max(1% of them, (Z/ACCURACY)²)``."""
    return max(math.ceil(MIN_FRACTION * numel), math.ceil((Z / ACCURACY) ** 2))


def cosine_tolerance(size: int) -> float:
    """The documented bound on ``|ĉ − c|`` for a sketch of ``size`` buckets: ``Z/√size``."""
    return Z / math.sqrt(size)


def _srl(x: int, s: int) -> int:
    """Logical right shift of an int64 value (``>>`` is arithmetic on signed ints)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _wrap(x: int) -> int:
    """A Python int wrapped to int64, as tensor arithmetic would."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _key(param_index: int, seed: int) -> int:
    """splitmix64 of ``(seed, param_index)``: where parameter ``param_index``'s indices start."""
    x = _wrap((seed + 1) * _GAMMA + param_index * _M1)
    x = _wrap((x ^ _srl(x, 30)) * _M1)
    x = _wrap((x ^ _srl(x, 27)) * _M2)
    return x ^ _srl(x, 31)


def _slots(x: Tensor, n: int) -> Tensor:
    """Hash int64 ``x`` in place to slots in ``[0, n)``: splitmix64's two multiply rounds, then
    the top 31 bits scaled to ``n`` (multiply-shift, no division). Slot ``2b + s`` is bucket
    ``b`` with sign ``(−1)^s``."""
    for shift, m in ((30, _M1), (27, _M2)):
        x.bitwise_xor_(x.bitwise_right_shift(shift).bitwise_and_((1 << (64 - shift)) - 1))
        x.mul_(m)
    return x.bitwise_right_shift_(33).bitwise_and_(_LOW31).mul_(n).bitwise_right_shift_(31)


def _global_flat(start: int, stop: int, local_shape: torch.Size, layout: ShardLayout | None,
                 device: torch.device) -> Tensor:
    """Indices in the global (unsharded) flattened tensor of local flat elements [start, stop)."""
    j = torch.arange(start, stop, dtype=torch.int64, device=device)
    if layout is None:
        return j
    out = torch.zeros_like(j)
    stride = 1
    for d in reversed(range(len(local_shape))):
        out += (j % local_shape[d] + layout.offset[d]) * stride
        j = j // local_shape[d]
        stride *= layout.global_shape[d]
    return out


class SecantSketch:
    """The sketch of the previous search's direction, and the comparison with the next one.

    ``measure(directions)`` sketches a direction given one tensor at a time; ``compare`` gives
    ``(cosine, norm_ratio)`` against the remembered sketch; ``remember`` keeps a sketch for the
    next search. Holds ``k + 1`` float64 numbers (the sketch and ``‖Δ‖²``)."""

    def __init__(self, numel: int, seed: int = 0) -> None:
        self.size = sketch_size(numel)
        self.seed = seed
        self.previous: Tensor | None = None

    @torch.no_grad()
    def measure(
        self,
        directions: Iterable[tuple[int, Tensor, ShardLayout | None]],
        group: object | None = None,
    ) -> Tensor:
        """Sketch of a direction given as ``(param index, local tensor, shard layout)``, with
        its squared norm as the last entry; the same on every rank of ``group``."""
        rank, world = distributed.rank_and_size(group)
        out: Tensor | None = None
        chunk = 0
        for index, delta, layout in directions:
            if out is None:  # float64 sums; MPS has no float64, so its sketch lives on the CPU
                device = torch.device("cpu") if delta.device.type == "mps" else delta.device
                out = torch.zeros(self.size + 1, dtype=torch.float64, device=device)
            key = _key(index, self.seed)
            flat = delta.reshape(-1)
            weight = 1.0 if layout is None else 1.0 / layout.replicas
            for start in range(0, flat.numel(), _CHUNK):
                # A replicated tensor is the same on every rank: each rank takes every
                # world-th of its chunks (numbered over replicated tensors only, as shards'
                # sizes differ between ranks). A shard is this rank's own: all of it.
                if layout is None:
                    chunk += 1
                    if (chunk - 1) % world != rank:
                        continue
                stop = min(start + _CHUNK, flat.numel())
                values = flat[start:stop].to(device=out.device, dtype=torch.float64) * weight
                slots = _slots(_global_flat(start, stop, delta.shape, layout, out.device).add_(key),
                               2 * self.size)
                acc = torch.bincount(slots, weights=values, minlength=2 * self.size)
                out[:-1] += acc[0::2] - acc[1::2]
                out[-1] += values.square().sum() / weight
        if out is None:
            out = torch.zeros(self.size + 1, dtype=torch.float64)
        return distributed.all_reduce_sum(out, group)

    def compare(self, sketch: Tensor) -> tuple[float | None, float | None]:
        """``(cosine, norm_ratio)`` of the sketched direction against the remembered one;
        ``None`` where undefined (no previous direction, or a zero one)."""
        prev = self.previous
        if prev is None or prev.numel() != sketch.numel():
            return None, None
        prev = prev.to(sketch.device)
        a, b = sketch[:-1], prev[:-1]
        denom = float(a.norm() * b.norm())
        cosine = float(a @ b) / denom if denom > 0 else None
        ratio = math.sqrt(float(sketch[-1] / prev[-1])) if float(prev[-1]) > 0 else None
        return cosine, ratio

    def remember(self, sketch: Tensor) -> None:
        self.previous = sketch

    def resize(self, numel: int) -> None:
        """More parameters to sketch: grow to their size and forget the previous direction
        (its buckets no longer line up)."""
        size = sketch_size(numel)
        if size != self.size:
            self.size, self.previous = size, None

    def nbytes(self) -> int:
        """Bytes held from the first search on: ``k + 1`` float64 numbers."""
        return (self.size + 1) * 8

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "seed": self.seed, "previous": self.previous}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if int(state["size"]) != self.size or int(state["seed"]) != self.seed:
            raise ValueError(
                f"sketch state has size {state['size']} and seed {state['seed']}, "
                f"this one {self.size} and {self.seed}"
            )
        prev = state["previous"]
        self.previous = None if prev is None else prev.detach().to(torch.float64, copy=True)

    def __repr__(self) -> str:
        return f"SecantSketch(size={self.size}, seed={self.seed})"
