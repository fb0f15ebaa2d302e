"""Checks shared by the two release formats' tests (the ``.npz`` of
tests/test_attacks.py, the directory of tests/test_release_directory.py): both
sign with the same HMAC key rules, so one sequence of refusals serves both."""
import os

import pytest

from ncdp_fast.release import ReleaseFileError

# Not the key any test signs with: a load with it must fail the HMAC.
WRONG_KEY = b"another secret key of 32 bytes.."


def check_key_refusals(save, load, signed, key, *, unsigned_path, short_path, short_key):
    """``signed`` (written with ``key``) refuses ``WRONG_KEY``; an unsigned release
    written to ``unsigned_path`` refuses any key (no HMAC to check); ``short_key``
    (not bytes, or under 16 bytes) is refused before anything is written at
    ``short_path``.  ``save(path, key=None)`` writes the release in its format,
    ``load(path, key=...)`` reads one back."""
    with pytest.raises(ReleaseFileError, match="HMAC mismatch"):
        load(signed, key=WRONG_KEY)
    unsigned = save(unsigned_path)
    with pytest.raises(ReleaseFileError, match="no HMAC in the release"):
        load(unsigned, key=key)
    with pytest.raises(TypeError, match="key: expected a secret of at least 16 bytes"):
        save(short_path, key=short_key)
    assert not os.path.exists(short_path)
