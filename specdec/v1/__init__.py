"""Generated from protos/specdec/v1/*.proto by `python -m specd.protogen`; do not edit."""
