"""The committed stubs in specdec/v1 must be what grpcio-tools generates from protos/."""
from specd.protogen import stale_files


def test_generated_stubs_are_fresh():
    assert stale_files() == [], "run `python -m specd.protogen` and commit the result"
