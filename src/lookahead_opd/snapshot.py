"""Anchor stores: where the extrapolator keeps the weights of the previous search.

The direction of a search is ``Δ = W_t − anchor``. ``FullSnapshot`` keeps the anchor exactly
(one copy of every extrapolated tensor, optionally on the CPU). ``LowRankSnapshot`` keeps it
as ``reference + U·Vᵀ`` per matrix, so a d×d weight costs 2·d·r floats instead of d²; the
reference (the initial weights, or a state dict the user gives) stays on the CPU or on disk.

Both are used one tensor at a time (``capture(i, t)`` / ``delta_run(i, …)``) so that a search
never holds more than one extra fp32 tensor besides the stores themselves. A search's pass
hands each run of ``Δ`` to ``observe``, and ends with ``advance``: the low-rank store does the
first half of its compression there, on the ``Δ`` the pass already holds, instead of reading the
weights and the reference once more.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Union

import torch
from torch import Tensor

__all__ = ["SnapshotStore", "FullSnapshot", "LowRankSnapshot", "ReferenceSpec"]

ReferenceSpec = Union[None, Mapping[str, Tensor], str, os.PathLike]
_CHUNK = 1 << 18  # elements of ``anchor − reference`` a low-rank store rebuilds or compresses
# at a time: one fp32 MiB, cached, and few enough groups that their dispatch costs little


def _as_device(device: str | torch.device | None) -> torch.device | None:
    return None if device is None else torch.device(device)


def _difference(base: Tensor, anchor: Tensor, out: Tensor) -> Tensor:
    """``out = base − anchor`` in fp32 (``out`` is an fp32 run, or rows, on ``base``'s device)."""
    if base.dtype == anchor.dtype == torch.float32 and base.device == anchor.device == out.device:
        return torch.sub(base, anchor, out=out)
    return out.copy_(base).sub_(anchor.to(out.device))


class SnapshotStore:
    """Interface of an anchor store over an ordered list of named tensors."""

    def add(self, names: Sequence[str], tensors: Sequence[Tensor]) -> None:
        """Register new tensors (in order) and make their current values the anchor."""
        raise NotImplementedError

    def capture(self, index: int, tensor: Tensor) -> None:
        """Make ``tensor`` (any float dtype) the anchor of entry ``index``."""
        raise NotImplementedError

    def anchor(self, index: int, device: torch.device) -> Tensor:
        """The anchor of entry ``index`` as a new fp32 tensor on ``device``."""
        raise NotImplementedError

    def anchor_run(self, index: int, start: int, stop: int, device: torch.device) -> Tensor:
        """Elements ``[start, stop)`` of entry ``index``'s flattened anchor on ``device``, in
        any float dtype, to read only. A search reads the anchor run by run through this, so a
        store need not build a whole tensor for it (this default builds the entry's anchor once
        and slices it until another entry is asked for)."""
        cached = getattr(self, "_run_cache", None)
        if cached is None or cached[:2] != (index, device):
            cached = self._run_cache = (index, device, self.anchor(index, device).reshape(-1))
        return cached[2][start:stop]

    def delta_run(self, index: int, start: int, stop: int, base: Tensor, out: Tensor) -> Tensor:
        """``base − anchor`` over elements ``[start, stop)`` of entry ``index``'s flattened
        anchor, in fp32, written into ``out`` (a float32 run of ``stop − start`` elements on
        ``base``'s device) and returned: how a search forms ``Δ``, run by run."""
        return _difference(base, self.anchor_run(index, start, stop, out.device), out)

    def adopt(self, index: int, tensor: Tensor) -> None:
        """Make ``tensor``'s values the anchor of entry ``index``, keeping ``tensor`` itself
        where the store can (the caller no longer uses it): a refused search's backup of the
        weights becomes the new anchor without a copy."""
        self.capture(index, tensor)

    def observe(self, index: int, start: int, delta: Tensor) -> None:
        """Elements ``[start, start + delta.numel())`` of this search's ``Δ = base − anchor``
        of entry ``index`` (fp32, to read now: the caller reuses the buffer). A search's pass
        feeds every entry's ``Δ`` in order from element 0, once; ``advance`` then uses it. This
        default ignores it."""

    def advance(self, index: int, tensor: Tensor, scale: float | None, *, own: bool = False,
                ) -> None:
        """Make ``tensor`` the anchor of entry ``index`` at the end of a search, where
        ``tensor = anchor + scale·Δ`` for the ``Δ`` that ``observe`` was given in this search
        (``scale=None``: it was not); ``own``: the caller no longer uses ``tensor``, as for
        ``adopt``. A store may build the new anchor from what it observed instead of reading
        ``tensor``; this default captures (or adopts) it."""
        if own:
            self.adopt(index, tensor)
        else:
            self.capture(index, tensor)

    def nbytes(self) -> int:
        """Bytes held for the anchors (a low-rank store's CPU/disk reference not included)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        raise NotImplementedError


class FullSnapshot(SnapshotStore):
    """Exact anchor: a copy of each tensor, on ``device`` (default: the tensor's own) and in
    ``dtype`` (default: the captured tensor's own, so the secant direction is exact)."""

    kind = "full"

    def __init__(
        self, device: str | torch.device | None = None, dtype: torch.dtype | None = None
    ) -> None:
        self.device = _as_device(device)
        self.dtype = dtype
        self._anchors: list[Tensor] = []

    def _copy(self, tensor: Tensor) -> Tensor:
        t = tensor.detach()
        return t.to(device=self.device or t.device, dtype=self.dtype or t.dtype, copy=True)

    def add(self, names: Sequence[str], tensors: Sequence[Tensor]) -> None:
        self._anchors.extend(self._copy(t) for t in tensors)

    def capture(self, index: int, tensor: Tensor) -> None:
        stored = self._anchors[index]
        if stored.dtype == (self.dtype or tensor.dtype) and stored.shape == tensor.shape:
            stored.copy_(tensor.detach())
        else:
            self._anchors[index] = self._copy(tensor)

    def anchor(self, index: int, device: torch.device) -> Tensor:
        return self._anchors[index].to(device=device, dtype=torch.float32, copy=True)

    def anchor_run(self, index: int, start: int, stop: int, device: torch.device) -> Tensor:
        return self._anchors[index].view(-1)[start:stop].to(device)

    def adopt(self, index: int, tensor: Tensor) -> None:
        stored, t = self._anchors[index], tensor.detach()
        if (stored.dtype, stored.device, stored.shape) == (t.dtype, t.device, t.shape) and (
            t.is_contiguous()
        ):
            self._anchors[index] = t
        else:
            self.capture(index, t)

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self._anchors)

    def __len__(self) -> int:
        return len(self._anchors)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "anchors": list(self._anchors)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_kind(state, self.kind, len(self))
        for i, a in enumerate(state["anchors"]):
            if a.shape != self._anchors[i].shape:
                raise ValueError(
                    f"snapshot entry {i} has shape {tuple(a.shape)}, "
                    f"expected {tuple(self._anchors[i].shape)}"
                )
            self._anchors[i] = a.detach().to(
                device=self.device or self._anchors[i].device, dtype=a.dtype, copy=True
            )

    def __repr__(self) -> str:
        return f"FullSnapshot(device={self.device}, dtype={self.dtype})"


def _check_kind(state: Mapping[str, Any], kind: str, n: int) -> None:
    if state.get("kind") != kind:
        raise ValueError(f"cannot load a {state.get('kind')!r} snapshot into a {kind!r} one")
    entries = state["anchors"] if kind == "full" else state["entries"]
    if len(entries) != n:
        raise ValueError(f"snapshot holds {len(entries)} tensors, this one has {n}")


class _Observed:
    """What ``LowRankSnapshot.observe`` keeps of one entry's ``Δ`` during a search: the warm
    start ``q`` it drew, the old ``U`` and ``VᵀQ``, ``Y = U·VᵀQ + Δ·q`` row by row, the
    ``n × r`` sum ``ΔᵀY``, the ``V`` it started from (a capture in between makes it stale), a
    row being assembled across runs, and the next element it expects."""

    __slots__ = ("q", "u", "vq", "y", "dty", "v", "row", "stop")

    def __init__(self, q: Tensor, u: Tensor, v: Tensor, m: int) -> None:
        n, r = q.shape
        self.q, self.u, self.v, self.vq, self.stop = q, u, v, v.to(q.device).T @ q, 0
        self.y = torch.empty(m, r, device=q.device)
        self.dty = torch.zeros(n, r, device=q.device)
        self.row = torch.empty(n, device=q.device)

    def rows(self, first: int, d: Tensor) -> None:
        """Whole rows ``first …`` of ``Δ``: their rows of ``Y``, and their share of ``ΔᵀY``."""
        y = self.y[first : first + d.shape[0]]
        torch.addmm(self.u[first : first + d.shape[0]] @ self.vq, d, self.q, out=y)
        self.dty.addmm_(d.T, y)


def _load_reference(reference: str | os.PathLike) -> Mapping[str, Tensor]:
    path = os.fspath(reference)
    if not os.path.exists(path):
        raise ValueError(f"reference file {path!r} does not exist")
    if path.endswith(".safetensors"):
        try:
            from safetensors.torch import load_file
        except ImportError:  # pragma: no cover - depends on the environment
            raise ValueError(
                "reading a .safetensors reference needs the 'safetensors' package"
            ) from None
        return load_file(path, device="cpu")
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


class LowRankSnapshot(SnapshotStore):
    """Compressed anchor: ``reference + U·Vᵀ`` for every tensor with ≥ 2 dims (viewed as
    ``shape[0] × rest``), a dense fp32 copy for 1-D tensors and for matrices too small to gain.

    ``U·Vᵀ`` is the rank-``rank`` approximation of ``anchor − reference`` by power iteration
    warm-started from the previous capture's ``V`` (as PowerSGD does), so one iteration per
    capture tracks a slowly rotating subspace; it is exact when the true rank is ≤ ``rank``.
    ``reference`` is ``None`` (a copy of the weights at construction, kept on
    ``reference_device``), a state dict, or a ``.safetensors`` / ``torch.save`` file path, looked
    up by parameter name. A reference copied from the weights is part of ``state_dict()``; a
    user-given one is not, and must be given again when resuming.
    """

    kind = "lowrank"
    MAX_COND = 100.0  # advance: R⁻¹ amplifies float32 rounding by up to cond², ~1e-3 here

    def __init__(
        self,
        rank: int,
        reference: ReferenceSpec = None,
        *,
        reference_device: str | torch.device = "cpu",
        power_iters: int = 1,
        seed: int = 0,
    ) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        if isinstance(power_iters, bool) or not isinstance(power_iters, int) or power_iters < 1:
            raise ValueError(f"power_iters must be a positive int, got {power_iters!r}")
        if reference is not None and not isinstance(reference, (Mapping, str, os.PathLike)):
            raise TypeError(
                f"reference must be None, a state dict or a file path, got {type(reference).__name__}"
            )
        self.rank = rank
        self.power_iters = power_iters
        self.reference_device = torch.device(reference_device)
        self._user_reference = reference is not None
        self._reference_source: Mapping[str, Tensor] | None = (
            _load_reference(reference) if isinstance(reference, (str, os.PathLike)) else reference
        )
        self._generator = torch.Generator().manual_seed(seed)
        self._names: list[str] = []
        self._shapes: list[torch.Size] = []
        self._refs: list[Tensor] = []
        # Per entry: {"dense": fp32 tensor} or {"U": m×r, "V": n×r}.
        self._entries: list[dict[str, Tensor]] = []
        self._last_group: tuple[tuple[int, int, torch.device, bool], Tensor] | None = None
        self._buffers: dict[torch.device, Tensor] = {}  # delta_run's rebuilt rows
        self._observed: dict[int, _Observed] = {}  # a search's Δ, per entry (observe)

    def compresses(self, shape: torch.Size | Sequence[int]) -> bool:
        """Whether a tensor of ``shape`` is kept as rank-``rank`` factors (at least 2-D and
        ``(m + n)·r < m·n`` for its ``m × n`` matrix view); otherwise it is stored dense."""
        shape = torch.Size(shape)
        if len(shape) < 2 or shape.numel() == 0:  # e.g. an FSDP rank's empty shard
            return False
        m, n = shape[0], shape.numel() // shape[0]
        return (m + n) * self.rank < m * n

    def add(self, names: Sequence[str], tensors: Sequence[Tensor]) -> None:
        for name, t in zip(names, tensors, strict=True):
            if self._reference_source is None:
                ref = t.detach().to(self.reference_device, copy=True)
            else:
                if name not in self._reference_source:
                    raise ValueError(f"reference has no tensor named {name!r}")
                ref = self._reference_source[name]
                if ref.shape != t.shape:
                    raise ValueError(
                        f"reference {name!r} has shape {tuple(ref.shape)}, "
                        f"the parameter {tuple(t.shape)}"
                    )
            self._names.append(name)
            self._shapes.append(t.shape)
            self._refs.append(ref)
            self._entries.append({})
            self.capture(len(self._entries) - 1, t)

    def capture(self, index: int, tensor: Tensor) -> None:
        self._observed.pop(index, None)
        self._compress(index, tensor)

    def observe(self, index: int, start: int, delta: Tensor) -> None:
        """For a compressed entry (and ``power_iters=1``), accumulate what the capture of a
        refused search's weights needs of ``Δ``: those weights are ``anchor + Δ``, so their
        difference from the reference is ``D = U·Vᵀ + Δ``, and with ``Q`` the orthonormalized
        warm start (drawn here, at element 0, as that capture would draw it) the power
        iteration's ``Y = D·Q = U·VᵀQ + Δ·Q`` and ``DᵀY = V·UᵀY + ΔᵀY`` need ``Δ`` only,
        which the pass holds: no other pass over the weights. Whole rows are multiplied; a row
        cut by a run's end waits in a buffer for the rest."""
        entry = self._entries[index]
        if "V" not in entry or self.power_iters != 1:
            return
        m, n = self._shapes[index][0], self._shapes[index].numel() // self._shapes[index][0]
        if start == 0:
            self._observed[index] = _Observed(self._warm_start(index, delta.device),
                                              entry["U"].to(delta.device), entry["V"], m)
        seen = self._observed.get(index)
        if seen is None or seen.stop != start:  # out of order: the capture reads the weights
            self._observed.pop(index, None)
            return
        size = delta.numel()
        seen.stop = start + size
        row, col = divmod(start, n)
        pos = 0
        if col:  # the rest of the row the previous run began
            pos = min(n - col, size)
            seen.row[col : col + pos].copy_(delta[:pos])
            if col + pos == n:
                seen.rows(row, seen.row.view(1, n))
                row += 1
        full = (size - pos) // n
        if full:
            seen.rows(row, delta[pos : pos + full * n].view(full, n))
            pos += full * n
        if pos < size:  # a row the next run finishes
            seen.row[: size - pos].copy_(delta[pos:])

    def advance(self, index: int, tensor: Tensor, scale: float | None, *, own: bool = False,
                ) -> None:
        """A refused search (``scale == 1``) with a whole observed ``Δ``: ``Y = P·R`` and the
        new ``V = DᵀP = V·UᵀP + ΔᵀY·R⁻¹``, the capture's result up to rounding. Otherwise
        (an accepted jump's ``anchor + (1 + c)·Δ``, whose products the pass did not form, or
        an ``R`` too ill-conditioned to invert: ``cond > MAX_COND``, a difference of rank
        < ``rank`` or a steep spectrum) the capture reads ``tensor``, from the same warm
        start."""
        seen = self._observed.pop(index, None)
        entry = self._entries[index]
        if seen is None or seen.v is not entry.get("V"):
            self._compress(index, tensor)
            return
        if scale != 1.0 or seen.stop != self._shapes[index].numel():
            self._compress(index, tensor, seen.q)  # the warm start drawn for it, not another
            return
        p, tri = torch.linalg.qr(seen.y)
        sv = torch.linalg.svdvals(tri)
        if not (bool(torch.isfinite(sv).all()) and float(sv[-1]) * self.MAX_COND > float(sv[0])):
            self._compress(index, tensor, seen.q)
            return
        dtp = torch.linalg.solve_triangular(tri, seen.dty, upper=True, left=False)  # Δᵀ·P
        v = entry["V"].to(p.device)
        self._last_group = None
        self._entries[index] = {"U": p.to(tensor.device),
                                "V": torch.addmm(dtp, v, seen.u.T @ p).to(tensor.device)}

    def _warm_start(self, index: int, device: torch.device) -> Tensor:
        """The orthonormal ``n × rank`` start of entry ``index``'s power iteration: the last
        capture's ``V``, or a random draw when there is none or it has a zero column (e.g.
        from an all-zero difference)."""
        q = self._entries[index].get("V")
        if q is None or not bool((q.norm(dim=0) > 0).all()):
            n = self._shapes[index].numel() // self._shapes[index][0]
            q = torch.randn(n, self.rank, generator=self._generator)
        return torch.linalg.qr(q.to(device)).Q

    def _compress(self, index: int, tensor: Tensor, q: Tensor | None = None) -> None:
        """Store ``tensor − reference`` as ``U·Vᵀ`` by ``power_iters`` power iterations from
        the warm start ``q`` (default: ``_warm_start``), a group of rows at a time."""
        t = tensor.detach()
        shape = self._shapes[index]
        self._last_group = None
        if not self.compresses(shape):
            self._entries[index] = {"dense": t.to(dtype=torch.float32, copy=True)}
            return
        m, n = shape[0], shape.numel() // shape[0]
        t2, ref = t.reshape(m, n), self._refs[index].reshape(m, n)
        step = self._group_rows(index)
        scratch = torch.empty(min(step, m) * n, device=t.device)

        def rows_of_diff() -> Iterator[tuple[int, Tensor]]:
            """``tensor − reference`` a block of rows at a time, into one scratch buffer: no
            temporary of the tensor's size (whose fresh pages cost more than the arithmetic
            on a CPU)."""
            for a in range(0, m, step):
                rows = t2[a : a + step]
                yield a, _difference(rows, ref[a : a + step], scratch[: rows.numel()].view_as(rows))

        q = (self._warm_start(index, t.device) if q is None else q).to(t.device)
        for _ in range(self.power_iters):
            y = torch.empty(m, self.rank, device=t.device)
            for a, d in rows_of_diff():
                torch.mm(d, q, out=y[a : a + step])
            p = torch.linalg.qr(y).Q
            q = torch.zeros(n, self.rank, device=t.device)
            for a, d in rows_of_diff():
                q.addmm_(d.T, p[a : a + step])
        # V doubles as the next capture's warm start (a zero column, e.g. from an all-zero
        # difference, makes the next capture draw a fresh random start instead).
        self._entries[index] = {"U": p, "V": q}

    def anchor(self, index: int, device: torch.device) -> Tensor:
        entry = self._entries[index]
        if "dense" in entry:
            return entry["dense"].to(device=device, dtype=torch.float32, copy=True)
        return self.anchor_run(index, 0, self._shapes[index].numel(), device).view(
            self._shapes[index])

    def anchor_run(self, index: int, start: int, stop: int, device: torch.device) -> Tensor:
        entry = self._entries[index]
        if "dense" in entry:
            return entry["dense"].view(-1)[start:stop].to(device)
        size = self._group_size(index)
        parts = []
        for g in range(start // size, (stop - 1) // size + 1):
            rows = self._rebuilt(index, g, device)
            parts.append(rows[max(start - g * size, 0) : stop - g * size])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def delta_run(self, index: int, start: int, stop: int, base: Tensor, out: Tensor) -> Tensor:
        """Per group of rows the run meets: rebuilt into one buffer, subtracted into ``out``
        (no concatenation of groups, no fresh tensor per group)."""
        entry = self._entries[index]
        if "dense" in entry:
            return _difference(base, entry["dense"].view(-1)[start:stop], out)
        size = self._group_size(index)
        for g in range(start // size, (stop - 1) // size + 1):
            lo, hi = max(start, g * size), min(stop, (g + 1) * size)
            rows = self._rebuilt(index, g, out.device, shared=True)
            _difference(base[lo - start : hi - start], rows[lo - g * size : hi - g * size],
                        out[lo - start : hi - start])
        return out

    def _group_rows(self, index: int) -> int:
        """Rows per group: the anchor is rebuilt, and compressed, a fixed group of rows at a
        time, so its values do not depend on how a caller splits its runs."""
        shape = self._shapes[index]
        return max(1, _CHUNK // (shape.numel() // shape[0]))

    def _group_size(self, index: int) -> int:
        """Elements per group of rows."""
        return self._group_rows(index) * (self._shapes[index].numel() // self._shapes[index][0])

    def _rebuilt(self, index: int, group: int, device: torch.device, shared: bool = False,
                 ) -> Tensor:
        """Rows ``group·G … (group+1)·G`` of ``reference + U·Vᵀ``, flattened, fp32; the last
        group asked for is kept, as runs come in order. ``shared``: written into one buffer per
        device that the next group overwrites (for a caller that reads it at once)."""
        key = (index, group, device, shared)
        if self._last_group is None or self._last_group[0] != key:
            shape, entry, g = self._shapes[index], self._entries[index], self._group_rows(index)
            ref = self._refs[index].reshape(shape[0], -1)[group * g : (group + 1) * g]
            out = None
            if shared:
                buffer = self._buffers.get(device)
                if buffer is None or buffer.numel() < ref.numel():
                    buffer = self._buffers[device] = torch.empty(
                        max(ref.numel(), self._group_size(index)), device=device)
                out = buffer[: ref.numel()].view(ref.shape)
            # One kernel writes reference + U·Vᵀ (no copy of the reference first).
            rows = torch.addmm(ref.to(device, torch.float32),
                               entry["U"][group * g : (group + 1) * g].to(device),
                               entry["V"].to(device).T, out=out)
            self._last_group = (key, rows.view(-1))
        return self._last_group[1]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for e in self._entries for t in e.values())

    def reference_nbytes(self) -> int:
        """Bytes of the reference copy this store owns (0 for a user-given reference)."""
        if self._user_reference:
            return 0
        return sum(r.numel() * r.element_size() for r in self._refs)

    def __len__(self) -> int:
        return len(self._entries)

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "rank": self.rank,
            "entries": [dict(e) for e in self._entries],
            "reference": None if self._user_reference else list(self._refs),
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_kind(state, self.kind, len(self))
        if state["rank"] != self.rank:
            raise ValueError(f"snapshot has rank {state['rank']}, this store rank {self.rank}")
        if state["reference"] is None and not self._user_reference:
            raise ValueError(
                "the saved low-rank snapshot used a user-given reference: pass the same "
                "reference= when building the optimizer that loads it"
            )
        if state["reference"] is not None:
            self._refs = [r.to(self.reference_device, copy=True) for r in state["reference"]]
        devices = [r.device for r in self._refs]
        self._entries = [
            {k: v.to(self._entry_device(i, devices), copy=True) for k, v in e.items()}
            for i, e in enumerate(state["entries"])
        ]
        self._generator.set_state(state["generator"])
        self._last_group = None
        self._observed = {}

    def _entry_device(self, index: int, devices: list[torch.device]) -> torch.device:
        current = self._entries[index]
        for v in current.values():
            return v.device
        return devices[index]

    def __repr__(self) -> str:
        return f"LowRankSnapshot(rank={self.rank}, reference_device={self.reference_device})"
