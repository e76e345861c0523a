"""The --api-keys file: tenants, the shared setting, comments and clear errors."""

from __future__ import annotations

import pytest

from kvwise.server.api_keys import KeyEntry, find_key, load_api_keys


def test_keys_tenants_comments_and_shared(tmp_path):
    path = tmp_path / "keys"
    path.write_text(
        "# all keys\nk1 alice\n\n  k2   bob  # trailing comment\nk3 carol shared\n"
        "k4 ops admin\nk5 dave shared-read\nk6 erin shared-write shared-read\n"
    )
    keys = load_api_keys(path)
    assert keys["k1"] == KeyEntry("alice") and keys["k2"] == KeyEntry("bob")
    assert keys["k3"] == KeyEntry("carol", shared_prefix=True, shared_read=True, shared_write=True)
    assert keys["k4"] == KeyEntry("ops", admin=True)
    assert keys["k5"] == KeyEntry("dave", shared_read=True)
    assert keys["k6"] == KeyEntry("erin", shared_read=True, shared_write=True)
    assert find_key(keys, "k2") == KeyEntry("bob") and find_key(keys, "k9") is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("k1\n", "expected `KEY TENANT"),
        ("k1 a b\n", "expected `KEY TENANT"),
        ("k1 a\nk1 b\n", "listed twice"),
        ("# nothing\n", "holds no keys"),
        ("k1 __shared__\n", "shared namespace"),
    ],
)
def test_bad_files(tmp_path, text, message):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_api_keys(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(tmp_path / "missing")
