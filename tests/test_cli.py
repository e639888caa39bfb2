"""The README's main job runs and reports small composition errors."""

from hypic.cli import main


def test_demo_self_check_passes(capsys) -> None:
    assert main(["demo", "--length", "40"]) == 0
    out = capsys.readouterr().out
    for family in ("linear", "scalar", "gla", "deltanet", "gdn", "kda", "dplr"):
        assert family in out
