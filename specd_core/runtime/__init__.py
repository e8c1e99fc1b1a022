"""The model runtime: loading a checkpoint from a directory (models), the lean
forward over a paged KV cache (lean, lean_step, paged_kv, lean_attention), what every model
core shares (model_core) and the session table it holds (sessions), running a
batch of checked calls (jobs), warm-up (warmup), batching concurrent sessions'
calls (batcher), the EAGLE draft head (eagle_head) and its features on the
wire (features), the Propose call's record (propose_call), call phases
(phases) and idle-session reaping (reaper). Nothing here imports grpc."""
