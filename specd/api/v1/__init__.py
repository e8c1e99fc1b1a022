"""Generated from protos/specd/api/v1/*.proto by `python -m specd.ops.protogen`; do not edit."""
