"""The model runtime: loading a checkpoint from a directory (models), the lean
forward with a preallocated KV cache (lean), the session table every model core
shares (model_core), batching concurrent sessions' calls (batcher), the EAGLE
draft head (eagle_head) and its features on the wire (features), call phases
(phases) and idle-session reaping (reaper). Nothing here imports grpc."""
