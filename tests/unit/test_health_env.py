"""NVIDIA's device-plugin health variables (DP_DISABLE_HEALTHCHECKS, DP_ENABLE_HEALTHCHECKS) mapped onto the
config's health policy, as NVIDIA's plugin reads them (internal/rm/health.go): `all` or `xids` turns checking
off, a list of XIDs is ignored on top of the application errors, and enabled XIDs win over disabled ones."""

from __future__ import annotations

import pytest

from agent.config import ConfigError, load_config, parse_config, with_health_env

DEFAULTS = load_config(None)


def actions(env: dict[str, str], config: str | None = None) -> tuple[dict[int, str], str, list[str]]:
    base = parse_config(config) if config else DEFAULTS
    mapped, said = with_health_env(base, env)
    return {x: mapped.health.xid_action(x) for x in (13, 31, 48, 63, 79, 94, 119)}, mapped.health.xid_default, said


def test_no_variables_change_nothing() -> None:
    assert with_health_env(DEFAULTS, {}) == (DEFAULTS, [])
    assert with_health_env(DEFAULTS, {"DP_DISABLE_HEALTHCHECKS": " , ", "DP_ENABLE_HEALTHCHECKS": ""}) == (
        DEFAULTS, [])


def test_listed_xids_are_ignored_and_the_others_keep_their_actions() -> None:
    xids, default, said = actions({"DP_DISABLE_HEALTHCHECKS": "48, 79"})
    assert xids == {13: "ignore", 31: "ignore", 48: "ignore", 63: "warn", 79: "ignore", 94: "warn",
                    119: "unhealthy"}
    assert default == "unhealthy"
    assert said == ["DP_DISABLE_HEALTHCHECKS=48, 79: XIDs 48, 79 ignored"]


@pytest.mark.parametrize("value", ["all", "ALL", "xids", "xids,48"])
def test_all_turns_every_xid_and_check_off(value: str) -> None:
    mapped, said = with_health_env(DEFAULTS, {"DP_DISABLE_HEALTHCHECKS": value})
    assert {mapped.health.xid_action(x) for x in range(1, 1024)} == {"ignore"}
    assert set(mapped.health.checks.model_dump().values()) == {"ignore"}
    assert said == [f"DP_DISABLE_HEALTHCHECKS={value}: every XID and health check ignored"]


def test_enabled_xids_win_over_disabled_ones_and_keep_a_worse_action() -> None:
    """13 (ignored by default) and 94 (warn) become unhealthy; 79 keeps node-fatal, even under `all`."""
    xids, default, said = actions({"DP_DISABLE_HEALTHCHECKS": "all", "DP_ENABLE_HEALTHCHECKS": "13,94,79"})
    assert xids == {13: "unhealthy", 31: "ignore", 48: "ignore", 63: "ignore", 79: "node-fatal", 94: "unhealthy",
                    119: "ignore"}
    assert default == "ignore"
    assert said == ["DP_DISABLE_HEALTHCHECKS=all: every XID and health check ignored",
                    "DP_ENABLE_HEALTHCHECKS=13,94,79: XID 13 unhealthy, XID 79 node-fatal, XID 94 unhealthy"]


def test_the_variables_apply_over_the_config_file() -> None:
    xids, _, _ = actions({"DP_ENABLE_HEALTHCHECKS": "63"},
                         "version: v1\nhealth:\n  xid:\n    63: node-fatal\n    119: warn\n")
    assert (xids[63], xids[119]) == ("node-fatal", "warn")


@pytest.mark.parametrize(("env", "line"), [
    ({"DP_DISABLE_HEALTHCHECKS": "48,abc"},
     "DP_DISABLE_HEALTHCHECKS: 'abc' is not an XID (a number 1..1023), 'all' or 'xids'; expected XIDs separated by "
     "commas"),
    ({"DP_ENABLE_HEALTHCHECKS": "0"},
     "DP_ENABLE_HEALTHCHECKS: '0' is not an XID (a number 1..1023), 'all' or 'xids'; expected XIDs separated by "
     "commas"),
    ({"DP_ENABLE_HEALTHCHECKS": "1024"},
     "DP_ENABLE_HEALTHCHECKS: '1024' is not an XID (a number 1..1023), 'all' or 'xids'; expected XIDs separated by "
     "commas"),
    ({"DP_DISABLE_HEALTHCHECKS": "1," * 3000},
     "DP_DISABLE_HEALTHCHECKS: 6000 characters, more than the 4096 it may have"),
])
def test_a_value_that_is_not_xids_is_one_line(env: dict[str, str], line: str) -> None:
    with pytest.raises(ConfigError) as refused:
        with_health_env(DEFAULTS, env)
    assert str(refused.value) == line


def test_enabling_all_makes_every_xid_mark_its_gpu() -> None:
    xids, default, said = actions({"DP_DISABLE_HEALTHCHECKS": "48", "DP_ENABLE_HEALTHCHECKS": "all"})
    assert xids == {13: "unhealthy", 31: "unhealthy", 48: "unhealthy", 63: "unhealthy", 79: "node-fatal",
                    94: "unhealthy", 119: "unhealthy"}
    assert default == "unhealthy"
    assert said == ["DP_DISABLE_HEALTHCHECKS=48: XIDs 48 ignored",
                    "DP_ENABLE_HEALTHCHECKS=all: every XID marks its GPU unhealthy or worse"]
