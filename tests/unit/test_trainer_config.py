"""Trainer config variants: loss normalisation and mismatch correction are chosen by `type`."""

import pytest

from rl.config import ConfigError, parse_config
from rl.trainer.config import TrainerConfig
from rl.trainer.loss_config import (
    AutoMismatchCorrection, DapoNorm, DrGrpoNorm, GeoMask, GSPOObjective, IcePopMask, MaskRatio, NoMismatchCorrection,
    SequenceTruncate, TruncateRatio,
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
    assert config.loss.mismatch == [TruncateRatio(cap=3.0)]  # one correction, as before they stacked
    toml = tmp_path / "t.toml"
    toml.write_text('[loss.mismatch]\ntype = "mask"\nmax_log_ratio = 0.5\n')
    assert parse_config(TrainerConfig, ["@", str(toml)]).loss.mismatch == [MaskRatio(max_log_ratio=0.5)]
    toml.write_text('[[loss.mismatch]]\ntype = "icepop"\n[[loss.mismatch]]\ntype = "geo_mask"\nlow = 0.9\n'
                    '[loss.objective]\ntype = "gspo"\n')
    stacked = parse_config(TrainerConfig, ["@", str(toml)]).loss
    assert stacked.mismatch == [IcePopMask(), GeoMask(low=0.9)] and stacked.objective == GSPOObjective()
    listed = parse_config(TrainerConfig, ["--loss.mismatch", '[{"type": "seq_truncate", "cap": 4}]'])
    assert listed.loss.mismatch == [SequenceTruncate(cap=4.0)]
    assert parse_config(TrainerConfig, ["--loss.mismatch.type", "none"]).loss.mismatch == NoMismatchCorrection()
    with pytest.raises(ConfigError, match="low"):
        parse_config(TrainerConfig, ["--loss.mismatch", '[{"type": "icepop", "low": 3, "high": 2}]'])


def test_unknown_variant_or_field_of_another_variant_is_an_error():
    with pytest.raises(ConfigError, match="loss.norm"):
        parse_config(TrainerConfig, ["--loss.norm.type", "mean"])
    with pytest.raises(ConfigError, match="cap"):
        parse_config(TrainerConfig, ["--loss.mismatch.type", "mask", "--loss.mismatch.cap", "2"])
