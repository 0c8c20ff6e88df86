"""ExtrapolationCallback for PyTorch Lightning: searches after optimizer steps (not
micro-batches), bit-identical with a never-improving gate, jump scalars reach the loggers,
and a checkpoint resume continues the schedule, the anchor and the history."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402

from lookahead_opd import PAPER_RULE, ExtrapolatingOptimizer  # noqa: E402
from lookahead_opd.integrations.lightning import ExtrapolationCallback  # noqa: E402

MICRO = 8
ACCUMULATE = 2
STEPS_PER_EPOCH = 2  # 4 micro-batches per epoch
STEPS = 8
SEARCH_STEPS = [1, 2, 4, 8]

logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def _problem():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 1, generator=g)
    x = torch.randn(STEPS_PER_EPOCH * ACCUMULATE * MICRO, 6, generator=g)
    xg = torch.randn(64, 6, generator=g)
    return x, torch.tanh(x @ w), xg, torch.tanh(xg @ w)


X, Y, XG, YG = _problem()


class Regression(L.LightningModule):
    def __init__(self, seed: int = 0, wrap_eval_fn=None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.wrap_eval_fn = wrap_eval_fn

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.02)
        if self.wrap_eval_fn is not None:
            opt = ExtrapolatingOptimizer(opt, self.wrap_eval_fn, **PAPER_RULE)
        sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=STEPS)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def gate_score(self) -> float:
        self.eval()
        with torch.no_grad():
            return -F.mse_loss(self.net(XG), YG).item()


class Recorder(Logger):
    """A real Logger that keeps what it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int, dict]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append((step, dict(metrics)))


def _trainer(tmp_path, callbacks=(), logger=False, **kw) -> L.Trainer:
    options = dict(
        default_root_dir=str(tmp_path),
        accelerator="cpu",
        devices=1,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=list(callbacks),
    )
    options.update(kw)
    return L.Trainer(**options)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(X, Y), batch_size=MICRO, shuffle=False)


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_searches_after_optimizer_steps_and_reach_the_loggers(tmp_path):
    module = Regression()
    steps_seen: list[int] = []
    trainer = None

    def gate() -> float:
        steps_seen.append(trainer.global_step)
        return module.gate_score()

    cb = ExtrapolationCallback(gate, **PAPER_RULE)
    recorder = Recorder()
    trainer = _trainer(tmp_path, [cb], logger=recorder)
    trainer.fit(module, _loader())
    assert trainer.global_step == STEPS
    assert [r.step for r in cb.history] == SEARCH_STEPS
    assert sorted(set(steps_seen)) == SEARCH_STEPS
    assert len(steps_seen) == sum(r.n_evals for r in cb.history)
    assert any(r.accepted is not None for r in cb.history)
    assert module.training  # the gate's eval() did not leak into training
    sent = [(s, m) for s, m in recorder.metrics if "extrapolation/accepted" in m]
    assert [s for s, _ in sent] == SEARCH_STEPS
    for (_, m), r in zip(sent, cb.history, strict=True):
        assert m["extrapolation/accepted"] == float(r.accepted is not None)
        assert m["extrapolation/coefficient"] == (r.accepted or 0.0)
        assert m["extrapolation/best_score"] == r.best_score
    assert sent[-1][1]["extrapolation/searches"] == len(SEARCH_STEPS)
    # The end of the run sends what the searches bought.
    (summary,) = [m for _, m in recorder.metrics if "extrapolation/summary/searches" in m]
    assert summary["extrapolation/summary/searches"] == len(SEARCH_STEPS)
    assert summary["extrapolation/summary/kept_jumps"] == sum(
        r.accepted is not None for r in cb.history
    )
    assert summary["extrapolation/summary/mean_secant_cosine"] == pytest.approx(
        sum(r.secant_cosine for r in cb.history[1:]) / (len(SEARCH_STEPS) - 1)
    )


def test_never_improving_gate_is_bit_identical(tmp_path):
    plain = Regression()
    _trainer(tmp_path / "a").fit(plain, _loader())
    module = Regression()
    calls = []

    def never_better() -> float:
        calls.append(module.gate_score())  # a real forward in eval mode
        return 0.0

    cb = ExtrapolationCallback(never_better, **PAPER_RULE)
    _trainer(tmp_path / "b", [cb]).fit(module, _loader())
    assert [r.step for r in cb.history] == SEARCH_STEPS
    assert all(r.accepted is None for r in cb.history)
    assert len(calls) == 2 * len(SEARCH_STEPS)
    _same(_params(plain), _params(module))


def test_the_default_rule_keeps_a_linear_ladder_and_resets_adams_state(tmp_path):
    """The callback's defaults: a ladder whose gain is linear in c keeps c = 16, and the jump
    restarts the AdamW state of the optimizer Lightning built, counted again from step 1."""
    module = Regression()
    ladder = itertools.cycle([0.0, 1.0, 2.0, 4.0, 8.0, 16.0])  # W_t, then the score is c
    cb = ExtrapolationCallback(ladder.__next__, schedule=[2])
    trainer = _trainer(tmp_path, [cb], max_steps=3)
    trainer.fit(module, _loader())
    assert [(r.step, r.accepted) for r in cb.history] == [(2, 16.0)]
    state = trainer.optimizers[0].state
    assert {int(state[p]["step"]) for p in module.parameters()} == {1}  # 3 steps, reset at 2


def _saver(tmp_path) -> ModelCheckpoint:
    """Checkpoints on the last batch of every epoch. (Lightning restarts a plain DataLoader
    from its first batch on resume, so only an epoch boundary resumes bit-exactly; saving in
    ``on_train_epoch_end`` instead replays one batch on resume, with or without us.)"""
    return ModelCheckpoint(
        dirpath=str(tmp_path / "ckpt"), save_top_k=-1, every_n_train_steps=STEPS_PER_EPOCH
    )


def _fit(tmp_path, ckpt_path=None, seed=0):
    module = Regression(seed=seed)
    cb = ExtrapolationCallback(module.gate_score, **PAPER_RULE)
    trainer = _trainer(tmp_path, [cb, _saver(tmp_path)], enable_checkpointing=True)
    trainer.fit(module, _loader(), ckpt_path=ckpt_path)
    return module, cb, trainer


def test_checkpoint_resume_continues_schedule_anchor_and_history(tmp_path):
    module, cb, _ = _fit(tmp_path)
    ckpts = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    by_step = {int(p.stem.split("step=")[1]): p for p in ckpts}
    assert sorted(by_step) == [2, 4, 6, 8]
    saved = torch.load(by_step[6], weights_only=False)["callbacks"]["ExtrapolationCallback"]
    assert saved["step_count"] == 6 and [r["step"] for r in saved["history"]] == [1, 2, 4]
    assert any(r.accepted is not None for r in cb.history[:3])  # the anchor matters
    decisions = [(r.step, r.scores, r.accepted) for r in cb.history]
    for step in (2, 6):
        resumed, rcb, trainer = _fit(tmp_path / f"r{step}", ckpt_path=by_step[step], seed=123)
        assert trainer.global_step == STEPS
        assert [(r.step, r.scores, r.accepted) for r in rcb.history] == decisions
        _same(_params(module), _params(resumed))


def test_resume_without_state_continues_the_schedule(tmp_path, caplog):
    module = Regression()
    _trainer(tmp_path, [_saver(tmp_path)], enable_checkpointing=True).fit(module, _loader())
    ckpt = next(p for p in (tmp_path / "ckpt").glob("*.ckpt") if "step=2" in p.name)
    module = Regression()
    cb = ExtrapolationCallback(module.gate_score, **PAPER_RULE)
    with caplog.at_level(logging.WARNING, logger="lookahead_opd.integrations.lightning"):
        _trainer(tmp_path / "r", [cb]).fit(module, _loader(), ckpt_path=ckpt)
    assert [r.step for r in cb.history] == [4, 8]
    assert "without saved extrapolation state" in caplog.text


def test_misuse_is_rejected(tmp_path):
    with pytest.raises(TypeError, match="no-argument callable"):
        ExtrapolationCallback(None, **PAPER_RULE)
    with pytest.raises(TypeError, match="unknown Extrapolator options.*'shedule'"):
        ExtrapolationCallback(lambda: 0.0, shedule="powers_of_two", **PAPER_RULE)
    with pytest.raises(ValueError, match="mode must be one of"):
        ExtrapolationCallback(lambda: 0.0, mode="up", **PAPER_RULE)
    with pytest.raises(ValueError, match="params must be one of"):
        ExtrapolationCallback(lambda: 0.0, params="everything", **PAPER_RULE)
    module = Regression(wrap_eval_fn=lambda: 0.0)
    trainer = _trainer(tmp_path, [ExtrapolationCallback(lambda: 0.0, **PAPER_RULE)])
    with pytest.raises(ValueError, match="already an ExtrapolatingOptimizer"):
        trainer.fit(module, _loader())


def test_extrapolating_optimizer_from_configure_optimizers(tmp_path):
    """The other route: the module returns an ExtrapolatingOptimizer (no callback)."""
    holder = {}
    module = Regression(wrap_eval_fn=lambda: holder["m"].gate_score())
    holder["m"] = module
    trainer = _trainer(tmp_path)
    trainer.fit(module, _loader())
    opt = trainer.optimizers[0]
    assert isinstance(opt, ExtrapolatingOptimizer)
    assert [r.step for r in opt.history] == SEARCH_STEPS
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02 * 0.1)  # the scheduler stepped
