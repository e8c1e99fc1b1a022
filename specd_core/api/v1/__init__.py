"""Generated from protos/specd_core/api/v1/*.proto by `python -m specd.protogen`; do not edit."""
