"""The committed stubs in specd/api/v1 must be what grpcio-tools generates from protos/."""
import pytest

from specd.ops.protogen import stale_files

pytestmark = pytest.mark.unit


def test_generated_stubs_are_fresh():
    assert stale_files() == [], "run `python -m specd.ops.protogen` and commit the result"
