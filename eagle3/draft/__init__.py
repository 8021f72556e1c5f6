"""The draft model: the EAGLE-3 layer (Llama-style and MLA), TTT attention, the target's head it shares, the draft
vocabulary (d2t/t2d), how stored samples are packed into its micro-batches, its checkpoint format and its export in
the layouts vLLM and speculators load.

May import eagle3's floor, gpu/, data/ and capture/ (the store it reads); never evaluate/, online/, train/ or the
stage modules above it (tests/test_layering.py).
"""
