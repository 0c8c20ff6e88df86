"""``accelerator.prepare(ExtrapolatingOptimizer(...))``: Accelerate wraps ours, only real
optimizer steps reach it under ``accelerator.accumulate``, the prepared scheduler drives our
``param_groups``, and ``save_state`` / ``load_state`` carry the extrapolator's state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from lookahead_opd import PAPER_RULE, ExtrapolatingOptimizer  # noqa: E402

STEPS = 8
ACCUMULATE = 2
MICRO = 8


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; give every test its own."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _problem():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 1, generator=g)
    x = torch.randn(STEPS * ACCUMULATE * MICRO, 6, generator=g)
    xg = torch.randn(64, 6, generator=g)
    return x, torch.tanh(x @ w), xg, torch.tanh(xg @ w)


X, Y, XG, YG = _problem()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(
    wrap: bool,
    *,
    eval_fn=None,
    steps: int = STEPS,
    save_at: int | None = None,
    save_dir: str | None = None,
    load_dir: str | None = None,
) -> dict:
    """``steps`` optimizer steps of ``ACCUMULATE`` micro-batches each in an Accelerate loop
    (batches in a fixed order; with ``load_dir`` the loop restores and continues)."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    net = _model()
    calls: list[int] = []

    def gate() -> float:
        calls.append(int(base.state[net[0].weight]["step"]) if base.state else 0)
        with torch.no_grad():
            return -F.mse_loss(net(XG), YG).item()

    base = torch.optim.AdamW(net.parameters(), lr=0.02)
    opt = ExtrapolatingOptimizer(base, eval_fn or gate, **PAPER_RULE) if wrap else base
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=STEPS)
    loader = DataLoader(TensorDataset(X, Y), batch_size=MICRO, shuffle=False)
    model, popt, loader, psched = accelerator.prepare(net, opt, loader, sched)
    start = 0
    if load_dir is not None:
        accelerator.load_state(load_dir)
        start = opt.step_count if wrap else int(base.state[net[0].weight]["step"])
        loader = accelerator.skip_first_batches(loader, start * ACCUMULATE)
    lrs, done = [], start
    for xb, yb in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(xb), yb))
            popt.step()
            psched.step()
            popt.zero_grad()
        if accelerator.sync_gradients:
            done += 1
            lrs.append(popt.param_groups[0]["lr"])
            if done == save_at:
                accelerator.save_state(save_dir)
            if done == steps:
                break
    return {"popt": popt, "opt": opt, "params": _params(net), "calls": calls, "lrs": lrs}


def test_prepare_wraps_ours_and_counts_optimizer_steps():
    r = _run(True)
    popt, opt = r["popt"], r["opt"]
    assert isinstance(popt, AcceleratedOptimizer) and popt.optimizer is opt
    assert popt.param_groups is opt.param_groups is opt.base.param_groups
    # Micro-batches do not reach our step: searches after optimizer steps 1, 2, 4, 8, and
    # every gate evaluation happens right after an optimizer step with that number.
    assert [rec.step for rec in opt.history] == [1, 2, 4, 8]
    assert opt.step_count == STEPS
    assert sorted(set(r["calls"])) == [1, 2, 4, 8]
    assert len(r["calls"]) == sum(rec.n_evals for rec in opt.history)
    assert any(rec.accepted is not None for rec in opt.history)
    # The prepared scheduler stepped once per optimizer step on our param_groups.
    assert r["lrs"] == pytest.approx(
        [0.02 * (1.0 - 0.9 * min(k, STEPS) / STEPS) for k in range(1, 9)]
    )


def test_never_improving_gate_is_bit_identical_to_plain():
    plain = _run(False)
    r = _run(True, eval_fn=lambda: 0.0)
    assert all(rec.accepted is None for rec in r["opt"].history)
    for name, p in plain["params"].items():
        assert torch.equal(p, r["params"][name]), name


def test_save_state_and_load_state_continue_the_search(tmp_path):
    full = _run(True, save_at=3, save_dir=str(tmp_path / "s3"))
    assert any(rec.accepted is not None for rec in full["opt"].history[:2])
    saved = torch.load(tmp_path / "s3" / "optimizer.bin", weights_only=True)
    assert saved["extrapolator"]["step_count"] == 3
    resumed = _run(True, load_dir=str(tmp_path / "s3"))
    a, b = full["opt"].history, resumed["opt"].history
    assert [(r.step, r.scores, r.accepted) for r in a] == [
        (r.step, r.scores, r.accepted) for r in b
    ]
    for name, p in full["params"].items():
        assert torch.equal(p, resumed["params"][name]), name
    assert resumed["lrs"] == full["lrs"][3:]
