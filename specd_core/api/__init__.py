"""Generated gRPC stubs of the wire API (proto package `specdec.v1`, from
protos/specd_core/api/v1/specdec.proto; regenerate with `python -m specd.protogen`)."""
