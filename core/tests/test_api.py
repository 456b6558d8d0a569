import pytest

from vllm_port.api import API_VERSION, ApiRange


def test_core_version_is_in_the_range_plugins_are_told_to_declare():
    assert API_VERSION in ApiRange(">=1.0,<2")


@pytest.mark.parametrize(
    ("text", "version", "inside"),
    [
        (">=1.0,<2", "1.9", True),
        (">=1.0,<2", "2.0", False),
        (">=1.2", "1.1", False),
        ("==1", "1.0", True),
        ("!=1.0", "1.0", False),
    ],
)
def test_range_membership(text, version, inside):
    assert (version in ApiRange(text)) is inside


@pytest.mark.parametrize("text", ["", "1.0", ">=one", "~=1.0", ">=1.0,,<2"])
def test_malformed_range_is_refused_with_the_bad_clause(text):
    with pytest.raises(ValueError, match="range"):
        ApiRange(text)
