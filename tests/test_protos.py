"""The committed stubs in specd_core/api/v1 must be what grpcio-tools generates from protos/."""
import pytest

from specd.protogen import stale_files

pytestmark = pytest.mark.unit


def test_generated_stubs_are_fresh():
    assert stale_files() == [], "run `python -m specd.protogen` and commit the result"
