"""Trainer config variants: loss normalisation and mismatch correction are chosen by `type`."""

import pytest

from rl.config import ConfigError, parse_config
from rl.trainer.config import (
    AutoMismatchCorrection, DapoNorm, DrGrpoNorm, MaskRatio, NoMismatchCorrection, TrainerConfig, TruncateRatio,
)


def test_defaults_keep_the_dapo_token_mean_and_leave_the_correction_to_the_device():
    config = parse_config(TrainerConfig, [])
    assert isinstance(config.loss.norm, DapoNorm) and isinstance(config.loss.mismatch, AutoMismatchCorrection)
    assert parse_config(TrainerConfig, ["--loss.mismatch.type", "none"]).loss.mismatch == NoMismatchCorrection()
    assert config.loss.beta == 0 and config.resume_step is None and config.packing


def test_variants_are_chosen_by_type_from_cli_and_toml(tmp_path):
    config = parse_config(TrainerConfig, ["--loss.norm.type", "dr_grpo", "--loss.norm.tokens-per-sample", "64",
                                          "--loss.mismatch.type", "truncate", "--loss.mismatch.cap", "3"])
    assert config.loss.norm == DrGrpoNorm(tokens_per_sample=64)
    assert config.loss.mismatch == TruncateRatio(cap=3.0)
    toml = tmp_path / "t.toml"
    toml.write_text('[loss.mismatch]\ntype = "mask"\nmax_log_ratio = 0.5\n')
    assert parse_config(TrainerConfig, ["@", str(toml)]).loss.mismatch == MaskRatio(max_log_ratio=0.5)


def test_unknown_variant_or_field_of_another_variant_is_an_error():
    with pytest.raises(ConfigError, match="loss.norm"):
        parse_config(TrainerConfig, ["--loss.norm.type", "mean"])
    with pytest.raises(ConfigError, match="cap"):
        parse_config(TrainerConfig, ["--loss.mismatch.type", "mask", "--loss.mismatch.cap", "2"])
