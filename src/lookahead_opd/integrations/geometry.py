"""Update-geometry analyses for weight updates ΔW = UΣVᵀ: the studies' tools.

Plain functions implementing the spectral diagnostics used by the EffOPD paper
("Learning to Foresee", arXiv 2605.11739): spectral norm and spectral ratio,
effective rank, top-energy ratio, singular-subspace alignment between two
updates, per-module update norms and the paper's norm rescaling of an early
update. ``summarize`` and ``matrix_metrics`` (what ``Extrapolator(log_geometry=True)``
records) are the core's, ``lookahead_opd.geometry``, and are re-exported here, so a study
imports one module; the conventions there hold for every function here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Literal, get_args

import torch

from lookahead_opd.geometry import (
    MATRIX_METRIC_KEYS,
    _as_matrix,
    _check_int,
    _check_tensor,
    _compute_dtype,
    _matrix_metrics,
    _metrics_from_sigma,
    _norm,
    _sigma_list,
    _svdvals,
    _to_floats,
    matrix_metrics,
    summarize,
)

__all__ = [
    "MATRIX_METRIC_KEYS",
    "effective_rank",
    "matrix_metrics",
    "rescale_update",
    "rescale_updates",
    "singular_values",
    "spectral_norm",
    "spectral_ratio",
    "state_dict_delta",
    "subspace_alignment",
    "subspace_alignment_per_direction",
    "summarize",
    "top_energy_ratio",
    "update_norms",
]

Side = Literal["left", "right"]


# --------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------


def _check_real(value: object, name: str) -> float:
    """Return ``value`` as a finite float, rejecting bools and non-numbers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return out


def _check_mapping(x: object, name: str) -> Mapping[str, torch.Tensor]:
    if not isinstance(x, Mapping):
        raise TypeError(f"{name} must be a Mapping of name -> tensor, got {type(x).__name__}")
    return x


def _check_fraction(fraction: object) -> float:
    f = _check_real(fraction, "fraction")
    if not 0.0 < f <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    return f


# --------------------------------------------------------------------------
# single-matrix metrics
# --------------------------------------------------------------------------


def singular_values(delta: torch.Tensor) -> torch.Tensor:
    """Singular values of ``delta`` (as a matrix), float32, descending, on its device.

    The spectrum Σ of ΔW = UΣVᵀ underlies every other metric in this module.
    """
    return _svdvals(_as_matrix(delta, "delta"), "delta").to(torch.float32)


def spectral_norm(delta: torch.Tensor) -> float:
    """Largest singular value σ1 of ``delta``: the strength of its dominant direction."""
    sigma = _sigma_list(_as_matrix(delta, "delta"), "delta")
    return sigma[0] if sigma else 0.0


def spectral_ratio(delta: torch.Tensor) -> float:
    """ρ = σ1 / ‖Δ‖_F, in (0, 1]: how much of the update is one direction (0.0 if zero).

    ρ = 1 for a rank-1 update and 1/sqrt(r) for a flat spectrum of rank r.
    """
    return _matrix_metrics(delta, "delta")["spectral_ratio"]


def effective_rank(delta: torch.Tensor) -> float:
    """exp of the entropy of the L1-normalised spectrum σ_i / Σσ_j (0.0 if zero).

    Roy & Vetterli's effective rank: 1 for rank-1, r for r equal singular values.
    """
    return _matrix_metrics(delta, "delta")["effective_rank"]


def top_energy_ratio(delta: torch.Tensor, fraction: float = 0.01) -> float:
    """R = sqrt(Σ_{i≤k} σ_i² / Σ_j σ_j²) with k = ceil(min(m, n) · fraction) (0.0 if zero).

    The share of the update's Frobenius norm carried by its top ``fraction`` of
    directions; ``fraction`` must be in (0, 1]. ``k`` is at least 1, and a
    1e-9 slack absorbs binary rounding (100 · 0.07 gives k = 7).
    """
    f = _check_fraction(fraction)
    sigma = _sigma_list(_as_matrix(delta, "delta"), "delta")
    return _metrics_from_sigma(sigma, f)["top1pct_ratio"]


# --------------------------------------------------------------------------
# two-matrix metrics
# --------------------------------------------------------------------------


def _singular_vectors(m: torch.Tensor, side: Side, name: str) -> tuple[torch.Tensor, int]:
    """Singular vectors (as columns) of ``side`` and the numerical rank of ``m``."""
    if m.numel() == 0:
        return m.new_zeros((m.shape[0] if side == "left" else m.shape[1], 0)), 0
    try:
        u, s, vh = torch.linalg.svd(m, full_matrices=False)
    except torch.linalg.LinAlgError as exc:
        raise ValueError(f"SVD of {name} failed (does it contain NaN or Inf?): {exc}") from exc
    sigma = s.tolist()
    if not all(math.isfinite(x) for x in sigma):
        raise ValueError(f"{name} has non-finite singular values (does it contain NaN or Inf?)")
    tol = sigma[0] * max(m.shape) * torch.finfo(m.dtype).eps
    rank = sum(1 for x in sigma if x > tol) if sigma[0] > 0.0 else 0
    return (u if side == "left" else vh.mT), rank


def subspace_alignment_per_direction(
    delta_a: torch.Tensor,
    delta_b: torch.Tensor,
    k: int = 20,
    side: Side = "left",
) -> list[float]:
    """|cos| between the i-th singular vectors of two updates, for i = 1..k'.

    ``side="left"`` compares columns of U, ``"right"`` columns of V. The
    absolute value removes the SVD sign ambiguity. k' = min(k, rank(a),
    rank(b)) with numerical ranks, so null-space directions (arbitrary) are
    never compared; a zero matrix gives ``[]``. Directions whose singular
    values are (near-)degenerate are not unique, so their cosines are unstable.
    """
    k = _check_int(k, "k", 1)
    if side not in get_args(Side):
        raise ValueError(f"side must be one of {get_args(Side)}, got {side!r}")
    a = _check_tensor(delta_a, "delta_a")
    b = _check_tensor(delta_b, "delta_b")
    if a.shape != b.shape:
        raise ValueError(
            f"delta_a and delta_b must have the same shape, got {tuple(a.shape)} "
            f"and {tuple(b.shape)}"
        )
    va, rank_a = _singular_vectors(_as_matrix(a, "delta_a"), side, "delta_a")
    vb, rank_b = _singular_vectors(_as_matrix(b, "delta_b"), side, "delta_b")
    kk = min(k, rank_a, rank_b)
    if kk == 0:
        return []
    va = va[:, :kk]
    vb = vb[:, :kk].to(device=va.device, dtype=va.dtype)
    cos = (va * vb).sum(dim=0).abs().tolist()
    return [min(1.0, c) for c in cos]


def subspace_alignment(
    delta_a: torch.Tensor,
    delta_b: torch.Tensor,
    k: int = 20,
    side: Side = "left",
) -> float:
    """Mean over i ≤ k' of |cos| between the i-th singular vectors of two updates.

    1.0 when the top directions coincide (up to sign), 0.0 when they are
    orthogonal or either update is zero; see
    :func:`subspace_alignment_per_direction` for the individual cosines.
    """
    cos = subspace_alignment_per_direction(delta_a, delta_b, k=k, side=side)
    return sum(cos) / len(cos) if cos else 0.0


# --------------------------------------------------------------------------
# state-dict level helpers
# --------------------------------------------------------------------------


def state_dict_delta(
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
    names: Iterable[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Float32 updates ``after[n] - before[n]``, computed on ``after[n]``'s device.

    By default over the keys of ``before`` that are also in ``after`` and
    floating-point in both (integer buffers are skipped); with ``names``, over
    exactly those keys, which must exist in both and be floating-point.
    """
    before = _check_mapping(before, "before")
    after = _check_mapping(after, "after")
    if names is None:
        selected = [n for n in before if n in after]
        explicit = False
    else:
        if isinstance(names, (str, bytes)):
            raise TypeError(
                f"names must be an iterable of key strings, not a single string {names!r}"
            )
        selected = list(names)
        explicit = True
        for n in selected:
            for label, sd in (("before", before), ("after", after)):
                if n not in sd:
                    raise ValueError(f"name {n!r} is not a key of {label}")
    out: dict[str, torch.Tensor] = {}
    for n in selected:
        b = _check_tensor(before[n], f"before[{n!r}]")
        a = _check_tensor(after[n], f"after[{n!r}]")
        if not (a.is_floating_point() and b.is_floating_point()):
            if explicit or a.is_floating_point() != b.is_floating_point():
                raise TypeError(
                    f"entry {n!r} must be floating-point in both before and after, got "
                    f"{b.dtype} and {a.dtype}"
                )
            continue
        if a.shape != b.shape:
            raise ValueError(
                f"entry {n!r} has shape {tuple(b.shape)} in before but {tuple(a.shape)} in after"
            )
        dtype = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
        diff = a.to(dtype) - b.to(device=a.device, dtype=dtype)
        out[n] = diff.to(torch.float32)
    return out


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def update_norms(
    delta: Mapping[str, torch.Tensor],
    group: Callable[[str], str] | str | None = None,
) -> dict[str, float]:
    """Frobenius norm of each update, optionally combined per group as sqrt(Σ‖·‖²).

    ``group`` is a callable mapping an entry name to a group name, or the
    string ``"module"`` (drop the last dotted component:
    ``model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj``;
    a name without a dot belongs to the root module ``""``).
    """
    delta = _check_mapping(delta, "delta")
    grouper: Callable[[str], str] | None
    if group is None:
        grouper = None
    elif isinstance(group, str):
        if group != "module":
            raise ValueError(f"group must be None, 'module' or a callable, got {group!r}")
        grouper = _module_of
    elif callable(group):
        grouper = group
    else:
        raise TypeError(f"group must be None, 'module' or a callable, got {type(group).__name__}")
    names = list(delta)
    norms = _to_floats([_norm(_check_tensor(delta[n], f"delta[{n!r}]")) for n in names])
    if grouper is None:
        return dict(zip(names, norms, strict=True))
    members: dict[str, list[float]] = {}
    for n, v in zip(names, norms, strict=True):
        g = grouper(n)
        if not isinstance(g, str):
            raise TypeError(f"group({n!r}) must return a str, got {type(g).__name__}")
        members.setdefault(g, []).append(v)
    return {g: math.hypot(*vs) for g, vs in members.items()}


# --------------------------------------------------------------------------
# norm rescaling
# --------------------------------------------------------------------------


def _rescale(x: torch.Tensor, target: float, beta: float) -> torch.Tensor:
    x = x.to(_compute_dtype(x))
    n = torch.linalg.vector_norm(x)
    positive = n > 0
    safe = torch.where(positive, n, torch.ones_like(n))
    scale = torch.where(positive, (1.0 - beta) + beta * target / safe, torch.ones_like(n))
    return x * scale


def rescale_update(
    early: torch.Tensor,
    target_norm: float,
    beta: float = 1.0,
) -> torch.Tensor:
    """The paper's norm scaling: ΔW_early · (1 + β(target − ‖ΔW_early‖) / ‖ΔW_early‖).

    ``beta=1`` gives ‖result‖_F = ``target_norm`` exactly; ``beta=0`` leaves the
    update unchanged. A zero update is returned unchanged (zeros). The result
    is float32 (float64 inputs stay float64) on ``early``'s device.
    """
    x = _check_tensor(early, "early")
    target = _check_real(target_norm, "target_norm")
    if target < 0.0:
        raise ValueError(f"target_norm must be >= 0, got {target_norm!r}")
    return _rescale(x, target, _check_real(beta, "beta"))


def rescale_updates(
    early: Mapping[str, torch.Tensor],
    final: Mapping[str, torch.Tensor],
    beta: float = 1.0,
) -> dict[str, torch.Tensor]:
    """Rescale each early update's Frobenius norm toward the matching final update's norm.

    Applies :func:`rescale_update` per key of ``early`` with target ‖final[key]‖_F;
    every key of ``early`` must be in ``final`` with the same shape.
    """
    early = _check_mapping(early, "early")
    final = _check_mapping(final, "final")
    b = _check_real(beta, "beta")
    names = list(early)
    tensors: list[torch.Tensor] = []
    for n in names:
        if n not in final:
            raise ValueError(f"name {n!r} of early is not a key of final")
        e = _check_tensor(early[n], f"early[{n!r}]")
        f = _check_tensor(final[n], f"final[{n!r}]")
        if e.shape != f.shape:
            raise ValueError(
                f"entry {n!r} has shape {tuple(e.shape)} in early but {tuple(f.shape)} in final"
            )
        tensors.append(e)
    targets = _to_floats([_norm(final[n].detach()) for n in names])
    return {n: _rescale(e, t, b) for n, e, t in zip(names, tensors, targets, strict=True)}
