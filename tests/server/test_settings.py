"""Server settings are checked when the server is configured: a bad limit names itself."""

import pytest

from hypic.server.settings import ServerSettings


@pytest.mark.parametrize("field, value", [
    ("max_queue", 0),  # every request waits in the queue first: with no room nothing is ever served
    ("max_choices", 0), ("max_concurrent", 0), ("max_segments", True), ("max_prompt_tokens", 0),
    ("request_timeout_s", 0), ("model_name", ""), ("api_key", ""), ("shutdown_drain", "yes"),
])
def test_bad_settings_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        ServerSettings(**{field: value})


def test_the_defaults_are_valid() -> None:
    s = ServerSettings()
    assert s.max_queue >= 1 and s.max_choices >= 1


def test_a_key_read_from_a_file_matches_without_its_newline_and_timeouts_are_finite() -> None:
    """Clients' bearer tokens are stripped; a key from a secret file kept its newline and never matched."""
    from hypic.server import ServerSettings

    assert ServerSettings(api_key="sk-file\n").api_key == "sk-file"
    for bad in (float("inf"), 1e9):
        with pytest.raises(ValueError, match="shutdown_timeout_s"):
            ServerSettings(shutdown_timeout_s=bad)
