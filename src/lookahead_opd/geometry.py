"""The update geometry ``Extrapolator(log_geometry=True)`` records per search: ``summarize``.

Per 2-D (or larger) update ΔW = UΣVᵀ: σ1, the spectral ratio σ1/‖ΔW‖_F, the effective rank,
the top-1% energy ratio and the Frobenius norm, averaged over the matrices, plus the total
norm (``matrix_metrics`` for one matrix). The other analyses of the EffOPD paper (subspace
alignment, per-module norms, state-dict deltas, norm rescaling) are studies' tools and live in
``lookahead_opd.integrations.geometry``, which builds on the helpers here.

Conventions shared by every function:

* Tensors may live on any device; heavy compute (SVD, norms) runs where the
  tensor is, and only scalar results are moved to the host as Python floats.
* Math runs in float32 regardless of the input dtype (bf16/fp16 inputs are
  upcast); float64 inputs keep float64, and scalar post-processing of the
  singular values is done in float64 on the host.
* A tensor with ``ndim > 2`` is viewed as the matrix ``(shape[0], -1)``.
  0-D and 1-D tensors are not matrices: matrix functions raise ``ValueError``
  on them and :func:`summarize` skips them (except for the total norm).
* Degenerate inputs (all-zero or empty matrices) give ``0.0``, never NaN.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import torch

__all__ = ["MATRIX_METRIC_KEYS", "matrix_metrics", "summarize"]

#: Keys returned by :func:`matrix_metrics` (and averaged by :func:`summarize`).
MATRIX_METRIC_KEYS: tuple[str, ...] = (
    "sigma1",
    "spectral_ratio",
    "effective_rank",
    "top1pct_ratio",
    "fro_norm",
)

# Slack used when computing k = ceil(r * fraction) so that e.g. 100 * 0.07
# (= 7.000000000000001 in binary floating point) gives k = 7, not 8.
_CEIL_SLACK = 1e-9


# --------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------


def _check_tensor(x: object, name: str) -> torch.Tensor:
    """Return ``x`` detached, after checking it is a real-valued tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_complex() or x.dtype == torch.bool:
        raise TypeError(
            f"{name} must be a real (floating-point or integer) tensor, got dtype {x.dtype}"
        )
    return x.detach()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _as_matrix(x: object, name: str) -> torch.Tensor:
    """Validate ``x`` and return it as a 2-D tensor in the compute dtype."""
    t = _check_tensor(x, name)
    if t.ndim < 2:
        raise ValueError(
            f"{name} must have ndim >= 2 to be treated as a matrix, got shape "
            f"{tuple(t.shape)}; 0-D and 1-D tensors are not matrices"
        )
    if t.ndim > 2:
        t = t.reshape(t.shape[0], math.prod(t.shape[1:]))
    return t.to(_compute_dtype(t))


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    out = int(value)
    if out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


# --------------------------------------------------------------------------
# numeric helpers
# --------------------------------------------------------------------------


def _svdvals(m: torch.Tensor, name: str) -> torch.Tensor:
    """Singular values of the 2-D compute-dtype tensor ``m`` (on its device)."""
    if m.numel() == 0:
        return m.new_zeros(0)
    try:
        return torch.linalg.svdvals(m)
    except torch.linalg.LinAlgError as exc:
        raise ValueError(f"SVD of {name} failed (does it contain NaN or Inf?): {exc}") from exc


def _sigma_list(m: torch.Tensor, name: str) -> list[float]:
    """Descending singular values of ``m`` as host float64 values, checked finite."""
    sigma = _svdvals(m, name).tolist()
    if not all(math.isfinite(s) for s in sigma):
        raise ValueError(f"{name} has non-finite singular values (does it contain NaN or Inf?)")
    return sigma


def _norm(x: torch.Tensor) -> torch.Tensor:
    """Frobenius / L2 norm of ``x`` as a 0-D tensor on x's device (fp32, fp64 for fp64)."""
    if x.dtype == torch.float64:
        return torch.linalg.vector_norm(x)
    if x.is_floating_point():
        return torch.linalg.vector_norm(x, dtype=torch.float32)
    return torch.linalg.vector_norm(x.to(torch.float32))


def _to_floats(tensors: Sequence[torch.Tensor]) -> list[float]:
    """Convert 0-D tensors to Python floats with one host transfer per device."""
    out = [0.0] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for idx in by_device.values():
        dtype = (
            torch.float64 if any(tensors[i].dtype == torch.float64 for i in idx) else torch.float32
        )
        values = torch.stack([tensors[i].reshape(()).to(dtype) for i in idx]).tolist()
        for i, v in zip(idx, values, strict=True):
            out[i] = float(v)
    return out


def _top_k(r: int, fraction: float) -> int:
    return min(r, max(1, math.ceil(r * fraction - _CEIL_SLACK)))


def _metrics_from_sigma(sigma: list[float], fraction: float = 0.01) -> dict[str, float]:
    """All scalar metrics from a descending list of singular values (float64 math)."""
    if not sigma or sigma[0] <= 0.0:
        return dict.fromkeys(MATRIX_METRIC_KEYS, 0.0)
    s1 = sigma[0]
    # Normalise by sigma1 first so squares cannot underflow / overflow.
    cum: list[float] = []
    acc = 0.0
    for s in sigma:
        acc += (s / s1) ** 2
        cum.append(acc)  # non-decreasing by construction
    total = cum[-1]  # >= 1 because the first term is exactly 1
    k = _top_k(len(sigma), fraction)
    l1 = math.fsum(sigma)
    entropy = -math.fsum(p * math.log(p) for p in (s / l1 for s in sigma) if p > 0.0)
    n_nonzero = sum(1 for s in sigma if s > 0.0)
    erank = min(float(n_nonzero), math.exp(max(entropy, 0.0)))  # clamp rounding only
    return {
        "sigma1": s1,
        "spectral_ratio": 1.0 / math.sqrt(total),
        "effective_rank": erank,
        "top1pct_ratio": math.sqrt(cum[k - 1] / total),
        "fro_norm": s1 * math.sqrt(total),
    }


# --------------------------------------------------------------------------
# one matrix
# --------------------------------------------------------------------------


def matrix_metrics(delta: torch.Tensor) -> dict[str, float]:
    """σ1, spectral ratio, effective rank, top-1% energy ratio and Frobenius norm, one SVD.

    Keys: ``sigma1``, ``spectral_ratio``, ``effective_rank``, ``top1pct_ratio``,
    ``fro_norm`` (all 0.0 for a zero or empty matrix).
    """
    return _matrix_metrics(delta, "delta")


def _matrix_metrics(delta: torch.Tensor, name: str) -> dict[str, float]:
    return _metrics_from_sigma(_sigma_list(_as_matrix(delta, name), name))


# --------------------------------------------------------------------------
# logging summary
# --------------------------------------------------------------------------


def summarize(
    deltas: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
    max_matrices: int | None = None,
) -> dict[str, float]:
    """Per-search log line: mean matrix metrics over ≥2-D entries plus the total norm.

    Returns the mean of each :func:`matrix_metrics` key over the matrices
    evaluated, ``fro_norm_total`` (sqrt of Σ‖·‖² over ALL entries, 1-D
    included) and ``n_matrices`` (number of matrices evaluated). With
    ``max_matrices=N`` only the first N ≥2-D entries (in iteration order) get
    an SVD, to keep logging on big models cheap; the total norm still covers
    everything. With no matrix evaluated the metric means are 0.0.
    """
    if isinstance(deltas, Mapping):
        items = [(str(n), t) for n, t in deltas.items()]
    elif isinstance(deltas, Sequence) and not isinstance(deltas, (str, bytes)):
        items = [(f"[{i}]", t) for i, t in enumerate(deltas)]
    else:
        raise TypeError(
            f"deltas must be a Mapping of name -> tensor or a sequence of tensors, got "
            f"{type(deltas).__name__}"
        )
    limit = None if max_matrices is None else _check_int(max_matrices, "max_matrices", 0)
    labels = [f"deltas{n}" if isinstance(deltas, Sequence) else f"deltas[{n!r}]" for n, _ in items]
    tensors = [_check_tensor(t, label) for label, (_, t) in zip(labels, items, strict=True)]
    total = math.hypot(*_to_floats([_norm(t) for t in tensors]))
    picked = [i for i, t in enumerate(tensors) if t.ndim >= 2]
    if limit is not None:
        picked = picked[:limit]
    matrices = [tensors[i] for i in picked]
    names = [labels[i] for i in picked]
    sums = dict.fromkeys(MATRIX_METRIC_KEYS, 0.0)
    for i, m in enumerate(matrices):
        for key, value in _matrix_metrics(m, names[i]).items():
            sums[key] += value
    count = len(matrices)
    out = {key: (v / count if count else 0.0) for key, v in sums.items()}
    out["fro_norm_total"] = total
    out["n_matrices"] = count
    return out
