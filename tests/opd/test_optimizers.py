"""The OPD loop's optimizer factory: names, import paths and callables resolve once, bad ones
fail in one line before any model loads, and Mechanic and Prodigy train through the loop."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_qwen2

pytest.importorskip("transformers")

from lookahead_opd import ExtrapolatingOptimizer  # noqa: E402
from lookahead_opd.integrations.opd.config import OPDConfig  # noqa: E402
from lookahead_opd.integrations.opd.engines import HFEngine  # noqa: E402
from lookahead_opd.integrations.opd.optimizers import (  # noqa: E402
    build_optimizer,
    optimizer_factory,
    optimizer_kwargs,
)
from lookahead_opd.integrations.opd.tasks import ArithmeticTask  # noqa: E402
from lookahead_opd.integrations.opd.tokenizer import char_tokenizer  # noqa: E402
from lookahead_opd.integrations.opd.train import check_run  # noqa: E402
from lookahead_opd.integrations.opd.trainer import OPDTrainer  # noqa: E402


def _params():
    return [torch.nn.Parameter(torch.ones(3))]


@pytest.mark.parametrize(("spec", "cls"), [
    ("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD), ("torch.optim.RAdam", torch.optim.RAdam),
    ("torch.optim:NAdam", torch.optim.NAdam)])
def test_names_and_import_paths_resolve(spec, cls):
    assert optimizer_factory(spec) is cls
    opt = build_optimizer(spec, _params(), lr=0.1, weight_decay=0.01)
    assert type(opt) is cls and opt.param_groups[0]["lr"] == 0.1
    assert opt.param_groups[0]["weight_decay"] == 0.01


def test_a_callable_is_its_own_factory_and_kwargs_win():
    def factory(params, **kwargs):
        return torch.optim.SGD(params, **kwargs)

    assert optimizer_factory(factory) is factory
    opt = build_optimizer(factory, _params(), lr=0.1, nesterov=True, momentum=0.5)
    assert build_optimizer("adamw", _params(), lr=0.1).param_groups[0]["lr"] == 0.1
    assert opt.param_groups[0]["nesterov"] and opt.param_groups[0]["momentum"] == 0.5
    assert build_optimizer("sgd", _params(), lr=0.1, momentum=0.9).param_groups[0]["momentum"] == 0.9


@pytest.mark.parametrize(("spec", "message"), [
    ("adamx", "is not one of adamw"), ("torch.optim.Nope", "has no 'Nope'"),
    ("no_such_pkg.Opt", "cannot import 'no_such_pkg'"), ("torch.optim.lr_scheduler.LambdaLR", None),
    ("mechanic:torch.nn.Linear", "Mechanic wraps a torch.optim.Optimizer class")])
def test_bad_names_fail_in_the_run_checks_before_any_model(spec, message):
    config = OPDConfig(task="arithmetic", optimizer=spec)
    if message is None:  # importable and callable: accepted here, judged when it is built
        check_run(config, check_paths=False)
        return
    with pytest.raises(ValueError, match=message):
        check_run(config, check_paths=False)


def test_optimizer_kwargs_are_a_json_object():
    assert optimizer_kwargs("") == {}
    assert optimizer_kwargs('{"betas": [0.9, 0.99], "d0": 1e-5}') == {"betas": (0.9, 0.99), "d0": 1e-5}
    for bad in ("[1]", "{d0: 1}"):
        with pytest.raises(ValueError, match="optimizer_kwargs must be a JSON object"):
            check_run(OPDConfig(task="arithmetic", optimizer_kwargs=bad), check_paths=False)


def test_prodigy_gets_its_authors_settings():
    pytest.importorskip("prodigyopt")
    from prodigyopt import Prodigy

    opt = build_optimizer("prodigy", _params(), lr=1e-4, warmup=True, d0=1e-5)
    group = opt.param_groups[0]
    assert type(opt) is Prodigy and group["lr"] == 1.0 and group["safeguard_warmup"]
    assert group["d0"] == 1e-5 and group["d"] == 1e-5  # its starting estimate, swept via d0
    assert not build_optimizer("prodigy", _params(), lr=1e-4).param_groups[0]["safeguard_warmup"]


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.mark.parametrize(("spec", "package"), [("prodigy", "prodigyopt"),
                                               ("mechanic:adamw", "mechanic_pytorch")])
@pytest.mark.slow
def test_lr_free_baselines_train_through_the_loop_under_effopd(tmp_path, tokenizer, spec, package):
    pytest.importorskip(package)
    student = tiny_qwen2(len(tokenizer), 0, tokenizer=tokenizer)
    teacher = tiny_qwen2(len(tokenizer), 1, tokenizer=tokenizer)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(30.0)
    start = copy.deepcopy(student.state_dict())
    config = OPDConfig(output_dir=str(tmp_path), batch_size=8, max_steps=4, learning_rate=1e-2,
                       max_new_tokens=4, eval_every=0, eval_size=8, gate_size=8, progress=False,
                       optimizer=spec, extrapolate=True, gate="neg_kl")
    t = OPDTrainer(config, student, teacher, ArithmeticTask(), HFEngine(student, tokenizer),
                   tokenizer=tokenizer)
    assert isinstance(t.optimizer, ExtrapolatingOptimizer)
    base = t.optimizer.base
    assert type(base).__module__.split(".")[0] == package
    result = t.train()
    assert len(result.jumps) == 3  # steps 1, 2, 4: the searches ran around the baseline
    moved = [not torch.equal(v, start[k]) for k, v in student.state_dict().items()]
    assert any(moved)
    assert all(torch.isfinite(v).all() for v in student.state_dict().values())


def test_a_trainer_takes_a_factory_in_place_of_the_name(tmp_path, tokenizer):
    built = []

    def factory(params, **kwargs):
        built.append(kwargs)
        return torch.optim.SGD(params, lr=kwargs["lr"])

    student = tiny_qwen2(len(tokenizer), 0, tokenizer=tokenizer)
    config = OPDConfig(output_dir=str(tmp_path), batch_size=4, max_steps=1, learning_rate=0.5,
                       max_new_tokens=4, eval_every=0, eval_size=8, progress=False)
    t = OPDTrainer(config, student, copy.deepcopy(student), ArithmeticTask(),
                   HFEngine(student, tokenizer), tokenizer=tokenizer, optimizer_factory=factory)
    assert type(t.optimizer) is torch.optim.SGD and built[0]["lr"] == 0.5
