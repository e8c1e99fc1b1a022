"""Generated gRPC stubs for proto package specdec (see specd/protogen.py)."""
