"""Anchor stores: where the extrapolator keeps the weights of the previous search.

The direction of a search is ``Δ = W_t − anchor``. ``FullSnapshot`` keeps the anchor exactly
(one copy of every extrapolated tensor, optionally on the CPU). ``LowRankSnapshot`` keeps it
as ``reference + U·Vᵀ`` per matrix, so a d×d weight costs 2·d·r floats instead of d²; the
reference (the initial weights, or a state dict the user gives) stays on the CPU or on disk.

Both are used one tensor at a time (``capture(i, t)`` / ``anchor(i, device)``) so that a search
never holds more than one extra fp32 tensor besides the stores themselves.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Union

import torch
from torch import Tensor

__all__ = ["SnapshotStore", "FullSnapshot", "LowRankSnapshot", "ReferenceSpec"]

ReferenceSpec = Union[None, Mapping[str, Tensor], str, os.PathLike]
_CHUNK = 1 << 16  # elements of ``anchor − reference`` a low-rank capture holds at a time


def _as_device(device: str | torch.device | None) -> torch.device | None:
    return None if device is None else torch.device(device)


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

    def adopt(self, index: int, tensor: Tensor) -> None:
        """Make ``tensor``'s values the anchor of entry ``index``, keeping ``tensor`` itself
        where the store can (the caller no longer uses it): a refused search's backup of the
        weights becomes the new anchor without a copy."""
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
        self._last_group: tuple[tuple[int, int, torch.device], Tensor] | None = None

    def compresses(self, shape: torch.Size | Sequence[int]) -> bool:
        """Whether a tensor of ``shape`` is kept as rank-``rank`` factors (at least 2-D and
        ``(m + n)·r < m·n`` for its ``m × n`` matrix view); otherwise it is stored dense."""
        shape = torch.Size(shape)
        if len(shape) < 2:
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
        t = tensor.detach()
        shape = self._shapes[index]
        self._last_group = None
        if not self.compresses(shape):
            self._entries[index] = {"dense": t.to(dtype=torch.float32, copy=True)}
            return
        m, n = shape[0], shape.numel() // shape[0]
        t2, ref = t.reshape(m, n), self._refs[index].reshape(m, n)
        step = self._group_rows(index)

        def rows_of_diff() -> Iterator[tuple[int, Tensor]]:
            """``anchor − reference`` a block of rows at a time: no temporary of the tensor's
            size (whose fresh pages cost more than the arithmetic on a CPU)."""
            for a in range(0, m, step):
                yield a, t2[a : a + step].float() - ref[a : a + step].to(t.device, torch.float32)

        entry = self._entries[index]
        q = entry.get("V")
        if q is None or not bool((q.norm(dim=0) > 0).all()):
            q = torch.randn(n, self.rank, generator=self._generator).to(t.device)
        q = torch.linalg.qr(q.to(t.device)).Q
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
        size = self._group_rows(index) * (self._shapes[index].numel() // self._shapes[index][0])
        parts = []
        for g in range(start // size, (stop - 1) // size + 1):
            rows = self._rebuilt(index, g, device)
            parts.append(rows[max(start - g * size, 0) : stop - g * size])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _group_rows(self, index: int) -> int:
        """Rows per group: the anchor is rebuilt, and compressed, a fixed group of rows at a
        time, so its values do not depend on how a caller splits its runs."""
        shape = self._shapes[index]
        return max(1, _CHUNK // (shape.numel() // shape[0]))

    def _rebuilt(self, index: int, group: int, device: torch.device) -> Tensor:
        """Rows ``group·G … (group+1)·G`` of ``reference + U·Vᵀ``, flattened, fp32; the last
        group asked for is kept, as runs come in order."""
        key = (index, group, device)
        if self._last_group is None or self._last_group[0] != key:
            shape, entry, g = self._shapes[index], self._entries[index], self._group_rows(index)
            ref = self._refs[index].reshape(shape[0], -1)[group * g : (group + 1) * g]
            # One kernel writes reference + U·Vᵀ (no copy of the reference first).
            rows = torch.addmm(ref.to(device, torch.float32),
                               entry["U"][group * g : (group + 1) * g].to(device),
                               entry["V"].to(device).T)
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

    def _entry_device(self, index: int, devices: list[torch.device]) -> torch.device:
        current = self._entries[index]
        for v in current.values():
            return v.device
        return devices[index]

    def __repr__(self) -> str:
        return f"LowRankSnapshot(rank={self.rank}, reference_device={self.reference_device})"
