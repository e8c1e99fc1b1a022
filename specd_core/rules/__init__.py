"""The rules that keep output exact, as pure functions: how logits become the
law a request samples from (sampling), which draft tokens to keep (tree, the
acceptance rules for chains and trees alike), the shape of a draft as data
(draft_shape), prompt-lookup drafting (ngram) and input checks (validation).
Nothing here imports grpc or loads a model."""
