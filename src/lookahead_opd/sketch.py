"""How straight is the path? The cosine between successive search directions, from a sketch.

At each search the extrapolator compares this window's direction ``Δ_n`` with the previous
one's: ``secant_cosine = cos(Δ_n, Δ_{n−1})`` (near 1 on a straight path, near 0 on a random
walk) and ``norm_ratio = ‖Δ_n‖/‖Δ_{n−1}‖``. Keeping ``Δ_{n−1}`` would cost a second copy of the
weights, so only a CountSketch of it is kept, hashed block by block so that sketching costs a
few vector operations per element and no per-element hash or scatter:

- element ``j`` of parameter ``i``, ``j`` its index in the *global* (unsharded) tensor, lies in
  block ``b = j // k`` at offset ``r = j mod k``;
- a fixed hash of ``(seed, i, b)`` gives the block a shift ``σ``, a sign ``ε`` and one of
  ``POOL`` rows ``t`` of a fixed table of random signs;
- the element goes, with sign ``ε·t[r]``, into bucket ``(r + σ) mod k``; a block therefore adds
  into the sketch as at most two contiguous slices.

Two elements of one block never share a bucket; two of different blocks share one with
probability ``1/k``, with independent signs unless their blocks drew the same row and the same
shift. A rank holding an FSDP shard sketches its part of the same global vector, and one
all-reduce (SUM) gives every rank the same sketch; replicated tensors are split between ranks
block by block, so each element is counted once.

Accuracy (derived in docs/algorithm.md): to first order the estimate
``<S_n, S_{n−1}> / (‖S_n‖‖S_{n−1}‖)`` has standard deviation at most
``(1 − c²)·√(1 + 1/POOL)/√k`` about the exact cosine ``c`` (``k`` odd): a Gaussian projection's
``(1 − c²)/√k``, which the CountSketch terms do not exceed, plus what block pairs that drew the
same row and shift add. So ``|ĉ − c| ≤ Z·√(1 + 1/POOL)/√k`` except with probability about
6·10⁻⁵ (``Z = 4``). ``k = max(MIN_SIZE, numel/MAX_BLOCKS)``, odd and at most ``MAX_SIZE``:
the bound is ``ACCURACY = 0.05`` or better, and a pass over a model up to ``MAX_BLOCKS·MAX_SIZE``
elements touches at most ``MAX_BLOCKS`` blocks plus one per tensor. The buckets add in float32
and each block's ``‖Δ‖²`` is a float32 dot product, summed over blocks in float64: rounding of
order 10⁻⁷ relative, far below the bound (the pass returns, and ranks all-reduce, float64).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import distributed
from .distributed import ShardLayout

__all__ = [
    "SecantSketch",
    "SketchPass",
    "Piece",
    "sketch_size",
    "cosine_tolerance",
    "ACCURACY",
    "Z",
    "POOL",
    "MIN_SIZE",
    "MAX_SIZE",
    "MAX_BLOCKS",
]

logger = logging.getLogger(__name__)

ACCURACY = 0.05  # the documented bound on |ĉ − c| at the smallest sketch
Z = 4.0  # standard deviations the bound allows
POOL = 16  # rows of random signs the blocks draw from (a power of two: drawn from hash bits)
# The sketch grows past MIN_SIZE so that a pass has at most this many blocks: each block is a
# few vector operations of the search's pass, so fewer, longer ones cost less dispatch (512
# blocks, k = 262,725 on a 135M model: 14% off a low-rank search there against 2048).
MAX_BLOCKS = 512
MIN_SIZE = math.ceil(Z**2 * (1 + 1 / POOL) / ACCURACY**2) | 1  # 6801: the bound is ACCURACY
MAX_SIZE = (1 << 20) + 1  # caps the sign table (POOL·k float32) at 64 MiB
_SCHEME = 3  # the hashing's version, saved with the state: sketches of two schemes don't compare

# splitmix64's constants (Steele, Lea & Flood 2014), as int64 (whose arithmetic wraps mod 2^64).
_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def sketch_size(numel: int) -> int:
    """Buckets for a direction of ``numel`` elements: ``max(MIN_SIZE, numel/MAX_BLOCKS)``,
    at most ``MAX_SIZE``, odd (the accuracy bound needs an odd ``k``)."""
    return min(MAX_SIZE, max(MIN_SIZE, math.ceil(numel / MAX_BLOCKS))) | 1


def cosine_tolerance(size: int) -> float:
    """The documented bound on ``|ĉ − c|`` for a sketch of ``size`` buckets:
    ``Z·√(1 + 1/POOL)/√size``."""
    return Z * math.sqrt(1 + 1 / POOL) / math.sqrt(size)


def _srl(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 ``x`` (``>>`` is arithmetic on signed ints)."""
    return x.bitwise_right_shift(s).bitwise_and_((1 << (64 - s)) - 1)


def _hash(x: Tensor, key: int) -> Tensor:
    """splitmix64 of ``key + (x + 1)·γ`` for each int64 in ``x`` (a new tensor): the
    generator's output function, whose 64 bits pass as independent uniform bits."""
    x = x.to(torch.int64).add(1).mul_(_GAMMA).add_(key)
    for shift, m in ((30, _M1), (27, _M2)):
        x.bitwise_xor_(_srl(x, shift)).mul_(m)
    return x.bitwise_xor_(_srl(x, 31))


def _global_flat(start: int, stop: int, local_shape: torch.Size, layout: ShardLayout,
                 device: torch.device) -> Tensor:
    """Indices in the global (unsharded) flattened tensor of local flat elements [start, stop)."""
    j = torch.arange(start, stop, dtype=torch.int64, device=device)
    out = torch.zeros_like(j)
    stride = 1
    for d in reversed(range(len(local_shape))):
        out += (j % local_shape[d] + layout.offset[d]) * stride
        j = j // local_shape[d]
        stride *= layout.global_shape[d]
    return out


def _contiguous_start(shape: torch.Size, layout: ShardLayout | None) -> int | None:
    """Where a local tensor's elements start in the global flattened tensor when they are one
    contiguous run of it (a whole tensor, or a shard of whole rows of dim 0); else ``None``."""
    if layout is None:
        return 0
    if tuple(shape[1:]) != tuple(layout.global_shape[1:]):
        return None
    return layout.offset[0] * math.prod(layout.global_shape[1:]) if len(shape) else 0


class Piece(NamedTuple):
    """A run ``[start, stop)`` of a local tensor's flattened elements that lies in one block.
    ``mine``: whether this rank sketches it (a replicated tensor's blocks are split between
    ranks). The rest says where its elements go."""

    index: int
    start: int
    stop: int
    mine: bool
    offset: int  # r of the first element; -1: the run is scattered (not one global run)
    shift: int
    row: int
    sign: float  # ε times the weight of a replicated shard (1/replicas)
    weight: float
    shape: torch.Size
    layout: ShardLayout | None


class SecantSketch:
    """The sketch of the previous search's direction, and the comparison with the next one.

    ``measure(directions)`` sketches a direction given one tensor at a time (``start`` gives
    the same piece by piece, for a pass that does more than sketch); ``compare`` gives
    ``(cosine, norm_ratio)`` against the remembered sketch; ``remember`` keeps a sketch for the
    next search. Holds ``k + 1`` float64 numbers (the sketch and ``‖Δ‖²``) and, from the first
    pass on, the ``POOL × k`` float32 sign table."""

    def __init__(self, numel: int, seed: int = 0) -> None:
        self.size = sketch_size(numel)
        self.seed = seed
        self.previous: Tensor | None = None
        self._signs: dict[torch.device, Tensor] = {}
        self._draws: dict[tuple[int, int, int], tuple[list[int], list[int], list[float]]] = {}

    def _key(self, index: int) -> int:
        """The hash key of parameter ``index`` (``-1``: the sign table)."""
        seed_key = int(_hash(torch.tensor([self.seed]), 0))
        return int(_hash(torch.tensor([index]), seed_key))

    def signs(self, device: torch.device) -> Tensor:
        """The ``POOL × k`` table of random ±1 (float32) on ``device``, built once."""
        table = self._signs.get(device)
        if table is None:
            cpu = self._signs.get(torch.device("cpu"))
            if cpu is None:
                bits = _hash(torch.arange(POOL * self.size), self._key(-1))
                cpu = torch.where(bits < 0, -1.0, 1.0).view(POOL, self.size)
                self._signs[torch.device("cpu")] = cpu
            table = self._signs[device] = cpu.to(device)
        return table

    def draws(self, index: int, blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(shift, row, sign)`` of each block of parameter ``index`` in ``blocks`` (int64):
        the top 31 bits of the block's hash scaled to ``[0, k)``, its low 4 bits, bit 4."""
        h = _hash(blocks, self._key(index))
        shift = _srl(h, 33).mul_(self.size).bitwise_right_shift_(31)
        row = h.bitwise_and(POOL - 1)
        sign = 1.0 - 2.0 * h.bitwise_right_shift(4).bitwise_and_(1).to(torch.float64)
        return shift, row, sign

    def _block_draws(self, index: int, first: int, last: int) -> tuple[list[int], list[int],
                                                                        list[float]]:
        key = (index, first, last)
        if key not in self._draws:  # a parameter's blocks are the same at every search
            drawn = self.draws(index, torch.arange(first, last + 1))
            self._draws[key] = tuple(t.tolist() for t in drawn)  # type: ignore[assignment]
        return self._draws[key]

    def start(self, device: torch.device, group: object | None = None) -> SketchPass:
        """A new pass, summing on ``device`` (the CPU for MPS, which has no float64)."""
        return SketchPass(self, device, group)

    @torch.no_grad()
    def measure(
        self,
        directions: Iterable[tuple[int, Tensor, ShardLayout | None]],
        group: object | None = None,
    ) -> Tensor:
        """Sketch of a direction given as ``(param index, local tensor, shard layout)``, with
        its squared norm as the last entry; the same on every rank of ``group``."""
        run: SketchPass | None = None
        for index, delta, layout in directions:
            run = run or self.start(delta.device, group)
            flat = delta.reshape(-1)
            for piece in run.pieces(index, delta, layout):
                if piece.mine:
                    x = run.scratch(delta.device)[: piece.stop - piece.start]
                    run.add(piece, x.copy_(flat[piece.start : piece.stop]))
        return (run or self.start(torch.device("cpu"), group)).result()

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
        """More parameters to sketch: size for ``numel`` elements and forget the previous
        direction (it did not cover them, so neither its cosine nor its norm compares)."""
        size = sketch_size(numel)
        if size != self.size:
            self.size = size
            self._signs, self._draws = {}, {}
        self.previous = None

    def nbytes(self) -> int:
        """Bytes held from the first search on: ``k + 1`` float64 numbers and the sign table
        (once per device it was used on)."""
        return (self.size + 1) * 8 + sum(t.numel() * 4 for t in self._signs.values())

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "seed": self.seed, "scheme": _SCHEME, "previous": self.previous}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("scheme") != _SCHEME:
            # Saved by a version that hashed differently: its buckets don't line up with ours.
            logger.warning("the saved secant sketch used another hashing; the next search "
                           "reports no secant_cosine")
            self.previous = None
            return
        if int(state["size"]) != self.size or int(state["seed"]) != self.seed:
            raise ValueError(
                f"sketch state has size {state['size']} and seed {state['seed']}, "
                f"this one {self.size} and {self.seed}"
            )
        prev = state["previous"]
        self.previous = None if prev is None else prev.detach().to(torch.float64, copy=True)

    def __repr__(self) -> str:
        return f"SecantSketch(size={self.size}, seed={self.seed})"


class SketchPass:
    """One sketch in the making: ``pieces`` says which runs of a tensor to sketch, ``add``
    sketches a run's values, ``result`` all-reduces the sum. The extrapolator drives it inside
    its own pass over the weights (which also copies them and writes a candidate), so the
    weights are read once."""

    def __init__(self, sketch: SecantSketch, device: torch.device, group: object | None) -> None:
        self.sketch, self.group = sketch, group
        self.rank, self.world = distributed.rank_and_size(group)
        self.device = torch.device("cpu") if device.type == "mps" else device
        self._buckets = torch.zeros(sketch.size, device=self.device)  # float32: see the module
        self._norm = torch.zeros(1, dtype=torch.float64, device=self.device)
        self._scratch: dict[torch.device, Tensor] = {}
        self._replicated = 0  # blocks of replicated tensors so far: they go round the ranks

    def scratch(self, device: torch.device) -> Tensor:
        """A float32 buffer of ``k`` elements on ``device``, for a piece's values."""
        if device not in self._scratch:
            self._scratch[device] = torch.empty(self.sketch.size, device=device)
        return self._scratch[device]

    def pieces(self, index: int, tensor: Tensor, layout: ShardLayout | None) -> Iterator[Piece]:
        """The runs of ``tensor`` (the local tensor of parameter ``index``) in order, each in
        one block; every element is in exactly one run."""
        k, numel = self.sketch.size, tensor.numel()
        weight = 1.0 if layout is None else 1.0 / layout.replicas
        begin = _contiguous_start(tensor.shape, layout)
        if begin is None:  # e.g. a shard of columns: its elements are scattered globally
            for start in range(0, numel, k):
                yield Piece(index, start, min(start + k, numel), True, -1, 0, 0, weight, weight,
                            tensor.shape, layout)
            return
        if numel == 0:
            return
        first, last = begin // k, (begin + numel - 1) // k
        shifts, rows, signs = self.sketch._block_draws(index, first, last)
        for n, b in enumerate(range(first, last + 1)):
            lo, hi = max(begin, b * k), min(begin + numel, (b + 1) * k)
            mine = True
            if layout is None:
                # A replicated tensor is the same on every rank: each rank takes every world-th
                # of its blocks (numbered over replicated tensors only, as shards' sizes differ
                # between ranks). A shard is this rank's own: all of it.
                mine = self._replicated % self.world == self.rank
                self._replicated += 1
            yield Piece(index, lo - begin, hi - begin, mine, lo - b * k, shifts[n], rows[n],
                        signs[n] * weight, weight, tensor.shape, layout)

    def add(self, piece: Piece, values: Tensor) -> None:
        """Sketch the float32 ``values`` of ``piece`` (``values`` is overwritten)."""
        if piece.offset < 0:
            self._add_scattered(piece, values)
            return
        k, m = self.sketch.size, piece.stop - piece.start
        values = values.to(self.device)
        self._norm.add_(torch.dot(values, values), alpha=piece.weight)
        values.mul_(self.sketch.signs(values.device)[piece.row, piece.offset : piece.offset + m])
        s = (piece.offset + piece.shift) % k
        head = min(m, k - s)
        self._buckets[s : s + head].add_(values[:head], alpha=piece.sign)
        if head < m:  # the run wraps around the end of the sketch
            self._buckets[: m - head].add_(values[head:], alpha=piece.sign)

    def _add_scattered(self, piece: Piece, values: Tensor) -> None:
        """``add`` for a run that is not one global run: the same buckets and signs, element
        by element (slower; only for shards that split dims other than the first)."""
        k, device = self.sketch.size, self.device
        g = _global_flat(piece.start, piece.stop, piece.shape, piece.layout, device)  # type: ignore[arg-type]
        block = torch.div(g, k, rounding_mode="floor")
        offset = g - block * k
        shift, row, sign = self.sketch.draws(piece.index, block)
        table = self.sketch.signs(device).reshape(-1)
        values = values.to(device)
        self._norm.add_(torch.dot(values, values), alpha=piece.weight)
        signed = values * sign.float() * table[row * k + offset] * piece.weight
        self._buckets.index_add_(0, (offset + shift) % k, signed)

    def result(self) -> Tensor:
        """The sketch with ``‖Δ‖²`` as its last entry (float64), summed over the ranks of the
        group."""
        out = torch.cat([self._buckets.to(torch.float64), self._norm])
        return distributed.all_reduce_sum(out, self.group)
