"""Closed-form and property tests for lookahead_opd.geometry."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lookahead_opd.integrations import geometry as g

FAST = settings(max_examples=40, deadline=None)


def _orthonormal(n: int, k: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=dtype))
    return q


def _with_spectrum(m: int, n: int, sigma: list[float], seed: int = 0) -> torch.Tensor:
    """A float64 m x n matrix with exactly the given singular values."""
    k = len(sigma)
    u = _orthonormal(m, k, seed)
    v = _orthonormal(n, k, seed + 1)
    return u @ torch.diag(torch.tensor(sigma, dtype=torch.float64)) @ v.T


# ---------------------------------------------------------------- closed forms


def test_rank_one_matrix():
    u = torch.tensor([1.0, 2.0, -2.0, 0.5, 0.0, 3.0])
    v = torch.tensor([0.3, -1.0, 2.0, 0.7, 1.1])
    s = 2.5
    delta = s * torch.outer(u, v)
    expected = s * u.norm().item() * v.norm().item()
    assert g.spectral_norm(delta) == pytest.approx(expected, rel=1e-5)
    assert g.spectral_ratio(delta) == pytest.approx(1.0, abs=1e-5)
    assert g.effective_rank(delta) == pytest.approx(1.0, abs=1e-4)
    assert g.top_energy_ratio(delta) == pytest.approx(1.0, abs=1e-5)
    sv = g.singular_values(delta)
    assert sv.dtype == torch.float32 and sv.shape == (5,)
    assert sv[0].item() == pytest.approx(expected, rel=1e-5)
    assert sv[1:].abs().max().item() < 1e-4 * expected


@pytest.mark.parametrize("n", [1, 4, 9, 100])
def test_identity(n):
    eye = torch.eye(n)
    assert g.effective_rank(eye) == pytest.approx(n, rel=1e-5)
    assert g.spectral_ratio(eye) == pytest.approx(1 / math.sqrt(n), rel=1e-5)
    assert g.spectral_norm(eye) == pytest.approx(1.0, rel=1e-6)
    for f in [0.01, 0.07, 0.1, 0.25, 0.5, 0.999, 1.0]:
        k = max(1, math.ceil(round(n * f, 9)))  # ceil(n * f), ignoring binary rounding
        assert g.top_energy_ratio(eye, f) == pytest.approx(math.sqrt(k / n), rel=1e-5)


def test_top_energy_ceil_is_not_fooled_by_binary_rounding():
    # 100 * 0.07 == 7.000000000000001 in binary floating point; k must still be 7.
    assert 100 * 0.07 > 7
    assert g.top_energy_ratio(torch.eye(100), 0.07) == pytest.approx(math.sqrt(0.07), rel=1e-6)


def test_diagonal_effective_rank_formula():
    sigma = [4.0, 3.0, 2.0, 1.0, 0.0]
    delta = torch.diag(torch.tensor(sigma))
    total = sum(sigma)
    p = [s / total for s in sigma if s > 0]
    expected = math.exp(-sum(x * math.log(x) for x in p))
    assert g.effective_rank(delta) == pytest.approx(expected, rel=1e-6)
    assert g.spectral_ratio(delta) == pytest.approx(4.0 / math.sqrt(30.0), rel=1e-6)
    # k = ceil(5 * 0.4) = 2 -> sqrt((16 + 9) / 30)
    assert g.top_energy_ratio(delta, 0.4) == pytest.approx(math.sqrt(25 / 30), rel=1e-6)
    assert g.singular_values(delta).tolist() == pytest.approx(sigma, abs=1e-6)


def test_matrix_metrics_matches_single_functions():
    delta = _with_spectrum(30, 20, [5.0, 3.0, 2.0, 1.5, 1.0, 0.5], seed=3).float()
    m = g.matrix_metrics(delta)
    assert set(m) == {"sigma1", "spectral_ratio", "effective_rank", "top1pct_ratio", "fro_norm"}
    assert m["sigma1"] == pytest.approx(5.0, rel=1e-5)
    assert m["spectral_ratio"] == pytest.approx(g.spectral_ratio(delta), rel=1e-6)
    assert m["effective_rank"] == pytest.approx(g.effective_rank(delta), rel=1e-6)
    assert m["top1pct_ratio"] == pytest.approx(5.0 / m["fro_norm"], rel=1e-5)
    assert m["fro_norm"] == pytest.approx(delta.norm().item(), rel=1e-5)
    assert all(isinstance(v, float) for v in m.values())


def test_higher_dim_tensor_is_reshaped_to_matrix():
    x = torch.randn(4, 3, 5, generator=torch.Generator().manual_seed(0))
    assert g.matrix_metrics(x) == pytest.approx(g.matrix_metrics(x.reshape(4, 15)))
    assert g.singular_values(x).shape == (4,)


def test_zero_matrix_gives_zero_not_nan():
    z = torch.zeros(6, 4)
    assert g.spectral_norm(z) == 0.0
    assert g.spectral_ratio(z) == 0.0
    assert g.effective_rank(z) == 0.0
    assert g.top_energy_ratio(z, 0.5) == 0.0
    assert g.matrix_metrics(z) == dict.fromkeys(g.MATRIX_METRIC_KEYS, 0.0)
    assert g.subspace_alignment(z, torch.eye(6, 4)) == 0.0
    assert g.subspace_alignment_per_direction(z, torch.eye(6, 4)) == []
    empty = torch.zeros(0, 4)
    assert g.matrix_metrics(empty) == dict.fromkeys(g.MATRIX_METRIC_KEYS, 0.0)


def test_tiny_values_do_not_underflow():
    delta = torch.eye(3) * 1e-30  # sigma**2 underflows in float32
    assert g.spectral_ratio(delta) == pytest.approx(1 / math.sqrt(3), rel=1e-5)
    assert g.effective_rank(delta) == pytest.approx(3.0, rel=1e-5)


# ---------------------------------------------------------------- alignment


def test_subspace_alignment_self_and_sign():
    a = _with_spectrum(12, 8, [6.0, 5.0, 4.0, 3.0, 2.0, 1.0], seed=5).float()
    for side in ("left", "right"):
        assert g.subspace_alignment(a, a, k=6, side=side) == pytest.approx(1.0, abs=1e-5)
        assert g.subspace_alignment(a, -a, k=6, side=side) == pytest.approx(1.0, abs=1e-5)
    cos = g.subspace_alignment_per_direction(a, -a, k=20)
    assert len(cos) == 6  # capped at the numerical rank, not min(m, n) = 8
    assert cos == pytest.approx([1.0] * 6, abs=1e-5)


def test_subspace_alignment_orthogonal_column_spaces():
    a = torch.zeros(6, 5)
    b = torch.zeros(6, 5)
    a[0, :] = torch.tensor([1.0, 2.0, 0.0, 1.0, 1.0])
    a[1, :] = torch.tensor([0.0, 1.0, 3.0, 0.0, -1.0])
    b[3, :] = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])
    b[4, :] = torch.tensor([2.0, 0.0, -1.0, 0.0, 0.0])
    assert g.subspace_alignment(a, b, side="left") == pytest.approx(0.0, abs=1e-6)
    # Right singular vectors are not orthogonal here, so the right side is > 0.
    assert g.subspace_alignment(a, b, side="right") > 0.1


def test_subspace_alignment_against_rotation():
    theta = 0.6
    sigma = [3.0, 2.0, 1.0]
    u = _orthonormal(5, 5, seed=11)
    v = _orthonormal(3, 3, seed=12)
    s = torch.diag(torch.tensor(sigma, dtype=torch.float64))
    a = u[:, :3] @ s @ v.T
    # Rotate u1 towards u5 (a direction outside a's column space) by theta.
    u_rot = u[:, :3].clone()
    u_rot[:, 0] = math.cos(theta) * u[:, 0] + math.sin(theta) * u[:, 4]
    b = u_rot @ s @ v.T
    left = g.subspace_alignment_per_direction(a.float(), b.float(), k=3, side="left")
    assert left == pytest.approx([math.cos(theta), 1.0, 1.0], abs=1e-5)
    assert g.subspace_alignment(a.float(), b.float(), k=3) == pytest.approx(
        (math.cos(theta) + 2.0) / 3.0, abs=1e-5
    )
    assert g.subspace_alignment(a.float(), b.float(), side="right") == pytest.approx(1.0, abs=1e-5)
    # k limits the number of compared directions.
    assert g.subspace_alignment(a.float(), b.float(), k=1) == pytest.approx(
        math.cos(theta), abs=1e-5
    )


def test_subspace_alignment_bad_inputs():
    a = torch.randn(4, 3)
    with pytest.raises(ValueError, match="same shape"):
        g.subspace_alignment(a, torch.randn(3, 4))
    with pytest.raises(ValueError, match="side"):
        g.subspace_alignment(a, a, side="up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k must be >= 1"):
        g.subspace_alignment(a, a, k=0)
    with pytest.raises(TypeError, match="k must be an int"):
        g.subspace_alignment(a, a, k=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ndim >= 2"):
        g.subspace_alignment(torch.randn(4), torch.randn(4))


# ---------------------------------------------------------------- state dicts / norms


def test_state_dict_delta():
    before = {
        "w": torch.ones(3, 2, dtype=torch.bfloat16),
        "b": torch.zeros(2),
        "steps": torch.tensor(3),
        "only_before": torch.ones(1),
    }
    after = {
        "w": torch.full((3, 2), 3.0, dtype=torch.bfloat16),
        "b": torch.tensor([1.0, -1.0]),
        "steps": torch.tensor(5),
        "only_after": torch.ones(1),
    }
    d = g.state_dict_delta(before, after)
    assert list(d) == ["w", "b"]  # shared floating-point keys, before's order
    assert all(t.dtype == torch.float32 for t in d.values())
    assert torch.equal(d["w"], torch.full((3, 2), 2.0))
    assert torch.equal(d["b"], torch.tensor([1.0, -1.0]))
    assert list(g.state_dict_delta(before, after, names=["b"])) == ["b"]
    with pytest.raises(ValueError, match="only_after"):
        g.state_dict_delta(before, after, names=["only_after"])
    with pytest.raises(ValueError, match="shape"):
        g.state_dict_delta({"w": torch.zeros(2, 2)}, {"w": torch.zeros(2, 3)})
    with pytest.raises(TypeError, match="steps"):
        g.state_dict_delta(before, after, names=["steps"])
    with pytest.raises(TypeError, match="single string"):
        g.state_dict_delta(before, after, names="w")
    with pytest.raises(TypeError, match="Mapping"):
        g.state_dict_delta([torch.zeros(1)], after)  # type: ignore[arg-type]


def test_update_norms_plain_and_grouped():
    delta = {
        "model.layers.0.mlp.up_proj.weight": torch.full((2, 2), 1.0),  # norm 2
        "model.layers.0.mlp.up_proj.bias": torch.tensor([3.0, 0.0, 0.0, 0.0]),  # norm 3
        "model.layers.0.mlp.down_proj.weight": torch.tensor([[0.0, 6.0]], dtype=torch.bfloat16),
        "scale": torch.tensor(-4.0),
    }
    plain = g.update_norms(delta)
    assert plain == pytest.approx(
        {
            "model.layers.0.mlp.up_proj.weight": 2.0,
            "model.layers.0.mlp.up_proj.bias": 3.0,
            "model.layers.0.mlp.down_proj.weight": 6.0,
            "scale": 4.0,
        }
    )
    by_module = g.update_norms(delta, group="module")
    assert by_module == pytest.approx(
        {
            "model.layers.0.mlp.up_proj": math.sqrt(13.0),
            "model.layers.0.mlp.down_proj": 6.0,
            "": 4.0,
        }
    )
    by_layer = g.update_norms(delta, group=lambda n: n.split(".")[2] if "layers" in n else "other")
    assert by_layer == pytest.approx({"0": 7.0, "other": 4.0})
    with pytest.raises(ValueError, match="'layer'"):
        g.update_norms(delta, group="layer")
    with pytest.raises(TypeError, match="callable"):
        g.update_norms(delta, group=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must return a str"):
        g.update_norms(delta, group=lambda n: 1)  # type: ignore[arg-type,return-value]


# ---------------------------------------------------------------- rescaling


def test_rescale_update_beta_one_hits_target():
    early = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
    out = g.rescale_update(early, 12.5)
    assert out.norm().item() == pytest.approx(12.5, rel=1e-5)
    # Direction is preserved.
    assert torch.allclose(out / out.norm(), early / early.norm(), atol=1e-6)


def test_rescale_update_beta_half_formula():
    early = torch.tensor([[3.0, 0.0], [0.0, 4.0]])  # norm 5
    out = g.rescale_update(early, 9.0, beta=0.5)
    factor = 1 + 0.5 * (9.0 - 5.0) / 5.0
    assert torch.allclose(out, early * factor)
    assert out.norm().item() == pytest.approx(7.0, rel=1e-6)  # halfway between 5 and 9
    assert torch.allclose(g.rescale_update(early, 9.0, beta=0.0), early)


def test_rescale_update_zero_and_dtypes():
    zero = torch.zeros(3, 3)
    out = g.rescale_update(zero, 5.0)
    assert torch.equal(out, zero) and not torch.isnan(out).any()
    bf = torch.randn(4, 4).to(torch.bfloat16)
    out_bf = g.rescale_update(bf, 2.0)
    assert out_bf.dtype == torch.float32
    assert out_bf.norm().item() == pytest.approx(2.0, rel=1e-5)
    with pytest.raises(ValueError, match="target_norm"):
        g.rescale_update(bf, -1.0)
    with pytest.raises(TypeError, match="target_norm"):
        g.rescale_update(bf, "2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="beta"):
        g.rescale_update(bf, 1.0, beta=float("nan"))


def test_rescale_updates_per_entry():
    gen = torch.Generator().manual_seed(2)
    early = {"a": torch.randn(3, 4, generator=gen), "b": torch.randn(5, generator=gen)}
    final = {"a": torch.randn(3, 4, generator=gen) * 10, "b": torch.randn(5, generator=gen) * 0.1}
    out = g.rescale_updates(early, final)
    assert list(out) == ["a", "b"]
    for k in out:
        assert out[k].norm().item() == pytest.approx(final[k].norm().item(), rel=1e-5)
    with pytest.raises(ValueError, match="'c'"):
        g.rescale_updates({"c": torch.zeros(1)}, final)
    with pytest.raises(ValueError, match="shape"):
        g.rescale_updates({"a": torch.zeros(4, 3)}, final)


# ---------------------------------------------------------------- summarize


def test_summarize_mapping_and_sequence():
    a = torch.eye(4)
    b = 2.0 * torch.outer(torch.ones(3), torch.ones(2))
    bias = torch.tensor([3.0, 4.0])
    s = g.summarize({"a": a, "bias": bias, "b": b})
    assert s["n_matrices"] == 2
    ma, mb = g.matrix_metrics(a), g.matrix_metrics(b)
    for key in g.MATRIX_METRIC_KEYS:
        assert s[key] == pytest.approx((ma[key] + mb[key]) / 2, rel=1e-6)
    assert s["fro_norm_total"] == pytest.approx(math.sqrt(4 + 24 + 25), rel=1e-6)
    assert g.summarize([a, bias, b]) == pytest.approx(s)

    first = g.summarize([bias, b, a], max_matrices=1)
    assert first["n_matrices"] == 1
    assert first["effective_rank"] == pytest.approx(1.0, abs=1e-4)  # only b evaluated
    assert first["fro_norm_total"] == pytest.approx(s["fro_norm_total"], rel=1e-6)
    none = g.summarize([a, b], max_matrices=0)
    assert none["n_matrices"] == 0 and none["effective_rank"] == 0.0


def test_summarize_empty_and_bad_inputs():
    for empty in ({}, []):
        s = g.summarize(empty)
        assert s["n_matrices"] == 0
        assert s["fro_norm_total"] == 0.0
        assert not any(math.isnan(v) for v in s.values())
    with pytest.raises(TypeError, match="Mapping"):
        g.summarize(torch.eye(3))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torch.Tensor"):
        g.summarize([torch.eye(2), [1.0, 2.0]])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="max_matrices"):
        g.summarize([torch.eye(2)], max_matrices=-1)
    with pytest.raises(TypeError, match="max_matrices"):
        g.summarize([torch.eye(2)], max_matrices=True)


# ---------------------------------------------------------------- dtypes / errors


def test_bf16_matches_fp32_copy():
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    y = x.float()
    assert g.matrix_metrics(x) == pytest.approx(g.matrix_metrics(y), rel=1e-5)
    assert g.singular_values(x).dtype == torch.float32
    assert g.top_energy_ratio(x, 0.3) == pytest.approx(g.top_energy_ratio(y, 0.3), rel=1e-5)
    assert g.subspace_alignment(x, x * 2) == pytest.approx(1.0, abs=1e-4)
    assert g.update_norms({"x": x})["x"] == pytest.approx(y.norm().item(), rel=1e-5)
    assert g.summarize([x]) == pytest.approx(g.summarize([y]), rel=1e-5)


def test_float64_input_uses_float64():
    x = _with_spectrum(10, 6, [1.0, 1e-9], seed=7)  # fp32 SVD noise is ~1e-7
    sv = g.singular_values(x)
    assert sv.dtype == torch.float32
    assert sv[1].item() == pytest.approx(1e-9, rel=1e-3)
    assert sv[2].item() < 1e-12


def test_requires_grad_input_is_fine():
    x = torch.randn(5, 3, requires_grad=True)
    assert g.spectral_norm(x) > 0
    assert not g.rescale_update(x, 1.0).requires_grad


@pytest.mark.parametrize(
    "fn",
    [g.singular_values, g.spectral_norm, g.spectral_ratio, g.effective_rank, g.matrix_metrics],
)
def test_bad_inputs(fn):
    with pytest.raises(ValueError, match="ndim >= 2"):
        fn(torch.ones(5))
    with pytest.raises(ValueError, match="ndim >= 2"):
        fn(torch.tensor(1.0))
    with pytest.raises(TypeError, match="torch.Tensor"):
        fn([[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(TypeError, match="dtype"):
        fn(torch.ones(2, 2, dtype=torch.complex64))
    with pytest.raises(TypeError, match="dtype"):
        fn(torch.ones(2, 2, dtype=torch.bool))
    bad = torch.ones(3, 3)
    bad[1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        fn(bad)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5, float("nan")])
def test_top_energy_bad_fraction_value(fraction):
    with pytest.raises(ValueError, match="fraction"):
        g.top_energy_ratio(torch.eye(3), fraction)


def test_top_energy_bad_fraction_type():
    with pytest.raises(TypeError, match="fraction"):
        g.top_energy_ratio(torch.eye(3), "0.5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fraction"):
        g.top_energy_ratio(torch.eye(3), True)


def test_integer_matrix_is_accepted():
    assert g.spectral_norm(torch.eye(3, dtype=torch.int64) * 2) == pytest.approx(2.0)


# ---------------------------------------------------------------- properties

shapes = st.tuples(st.integers(1, 9), st.integers(1, 9))
seeds = st.integers(0, 2**31 - 1)


def _rand(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@FAST
@given(shape=shapes, seed=seeds)
def test_property_bounds(shape, seed):
    x = _rand(shape, seed)
    m = g.matrix_metrics(x)
    assert 0.0 < m["spectral_ratio"] <= 1.0
    assert 1.0 - 1e-6 <= m["effective_rank"] <= min(shape) + 1e-6
    assert 0.0 < m["top1pct_ratio"] <= 1.0
    assert m["sigma1"] <= m["fro_norm"] * (1 + 1e-6)
    assert m["fro_norm"] == pytest.approx(x.norm().item(), rel=1e-4)


@FAST
@given(
    shape=shapes,
    seed=seeds,
    fractions=st.lists(st.floats(1e-6, 1.0), min_size=2, max_size=6),
)
def test_property_top_energy_monotone(shape, seed, fractions):
    x = _rand(shape, seed)
    values = [g.top_energy_ratio(x, f) for f in sorted(fractions)]
    assert all(a <= b for a, b in zip(values, values[1:], strict=False))
    assert g.top_energy_ratio(x, 1.0) == pytest.approx(1.0, abs=1e-12)


@FAST
@given(
    shapes_=st.lists(
        st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple), min_size=0, max_size=5
    ),
    seed=seeds,
)
def test_property_summarize_total_norm(shapes_, seed):
    tensors = [_rand(s, seed + i) for i, s in enumerate(shapes_)]
    s = g.summarize(tensors)
    direct = math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))
    assert s["fro_norm_total"] == pytest.approx(direct, rel=1e-5, abs=1e-12)
    assert s["n_matrices"] == sum(1 for t in tensors if t.ndim >= 2)
    assert not any(math.isnan(v) for v in s.values())


@FAST
@given(shape=shapes, seed=seeds, target=st.floats(0.0, 1e3), beta=st.floats(0.0, 1.0))
def test_property_rescale(shape, seed, target, beta):
    x = _rand(shape, seed)
    out = g.rescale_update(x, target, beta=beta)
    n = x.norm().item()
    assert out.norm().item() == pytest.approx(n + beta * (target - n), rel=1e-4, abs=1e-5)


@FAST
@given(shape=shapes, seed=seeds, side=st.sampled_from(["left", "right"]))
def test_property_alignment_in_unit_interval(shape, seed, side):
    a, b = _rand(shape, seed), _rand(shape, seed + 1)
    cos = g.subspace_alignment_per_direction(a, b, side=side)
    assert len(cos) == min(shape)
    assert all(0.0 <= c <= 1.0 for c in cos)
    assert g.subspace_alignment(a, a * 3.0, side=side) == pytest.approx(1.0, abs=1e-4)
