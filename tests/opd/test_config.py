"""OPDConfig: CLI from the dataclass, yaml files, and one clear error per bad input (its own
values in ``validate``, the rest in ``train.check_run``)."""

import json

import pytest

from lookahead_opd.integrations.opd.config import OPDConfig
from lookahead_opd.integrations.opd.train import check_run, parse_config


def _saved_model_dir(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text("{}")
    return str(d)


def test_cli_flags_and_yaml(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("learning_rate: 1.0e-5\nextrapolate: true\nbatch_size: 8\n")
    c = parse_config(["--config", str(cfg_file), "--batch_size", "4", "--gate", "neg_kl"])
    assert (c.learning_rate, c.extrapolate, c.batch_size, c.gate) == (1e-5, True, 4, "neg_kl")
    assert parse_config([]).learning_rate == OPDConfig().learning_rate


def test_config_file_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        parse_config(["--config", str(tmp_path / "missing.yaml")])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"learnin_rate": 1}))
    with pytest.raises(ValueError, match="unknown option.*learnin_rate"):
        parse_config(["--config", str(bad)])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be > 0"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"engine": "tgi"}, "engine must be one of"),
        ({"loss": "kl"}, "loss must be one of"),
        ({"task": "chess"}, "unknown task"),
        ({"snapshot": "lowrank"}, "needs rank"),
        ({"coefficients": "1,two"}, "coefficients must be"),
        ({"temperature": 0.0}, "temperature"),
        ({"jsd_beta": 2.0}, "jsd_beta"),
        ({"report_to": "mlflow"}, "report_to must be one of"),
        ({"batch_size": 6, "gradient_accumulation_steps": 4}, "divisible"),
    ],
)
def test_bad_options_fail_before_loading(tmp_path, change, message):
    base = {"student": _saved_model_dir(tmp_path, "s"), "teacher": _saved_model_dir(tmp_path, "t")}
    with pytest.raises(ValueError, match=message):
        check_run(OPDConfig(**{**base, **change}))


def _fake_hub_cache(root, repo_id):
    """A Hugging Face cache holding ``repo_id``'s config.json, as a download leaves it."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")


def test_model_paths(tmp_path, monkeypatch):
    from huggingface_hub import constants

    ok = _saved_model_dir(tmp_path, "s")
    _fake_hub_cache(tmp_path / "hub", "Qwen/Qwen2.5-0.5B")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    check_run(OPDConfig(student=ok, teacher="Qwen/Qwen2.5-0.5B"))  # in the cache: no network
    with pytest.raises(ValueError, match="'Qwen/nothing' was not found.*need no network"):
        check_run(OPDConfig(student=ok, teacher="Qwen/nothing"))
    with pytest.raises(ValueError, match="student path .* does not exist"):
        check_run(OPDConfig(student=str(tmp_path / "nope"), teacher=ok))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        check_run(OPDConfig(student=ok, teacher=str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="--teacher is required"):
        check_run(OPDConfig(student=ok))


def test_validate_checks_only_the_configs_own_values(tmp_path):
    """``validate`` passes what only the rest of the package can judge (``check_run`` does)."""
    config = OPDConfig(task="chess", optimizer="no.such:Optimizer", student=str(tmp_path / "x"))
    config.validate()
    with pytest.raises(ValueError, match="cannot import 'no.such'"):
        check_run(config, check_paths=False)


def test_the_configs_names_match_the_registries():
    """The names the config repeats (so as to import none of the loop) are the registries'."""
    from lookahead_opd.integrations.opd import config, losses
    from lookahead_opd.selection import PARAM_SELECTORS

    assert config.LOSS_NAMES == tuple(losses.LOSSES)
    assert set(config.LOSS_OPTIONS) == {v for spec in losses.LOSS_INPUTS.values()
                                        for v in spec.options.values()}
    assert OPDConfig().topk == losses.DEFAULT_TOPK
    assert config.PARAM_SELECTOR_NAMES == tuple(PARAM_SELECTORS)
