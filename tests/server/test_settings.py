"""Server settings are checked when the server is configured: a bad limit names itself."""

import pytest

from hypic.server.settings import ServerSettings


@pytest.mark.parametrize("field, value", [
    ("max_queue", 0),  # every request waits in the queue first: with no room nothing is ever served
    ("max_choices", 0), ("max_concurrent", 0), ("max_segments", True), ("max_prompt_tokens", 0),
    ("request_timeout_s", 0), ("model_name", ""), ("api_key", ""),
])
def test_bad_settings_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        ServerSettings(**{field: value})


def test_the_defaults_are_valid() -> None:
    s = ServerSettings()
    assert s.max_queue >= 1 and s.max_choices >= 1
