"""The model and how it runs: the forward pass, the preallocated KV cache, attention masks, fixed-shape and graphed
decoding, the vision tower, model folders and random architectures. Knows nothing of JSON or driving."""
