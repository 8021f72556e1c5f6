"""Scoring a draft: acceptance simulated on held-out states and walked as a served greedy decode
(acceptance.py), the served check through vLLM's own speculative decoding (served_eval.py), and the plots.

May import eagle3's floor, gpu/, data/, capture/, engine/ and draft/ (the exported draft it loads); never online/,
train/ or the stage modules (tests/test_layering.py).
"""
