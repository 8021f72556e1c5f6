"""The draft: the EAGLE-3 model, TTT attention, loss, batches, training (one device and DDP),
checkpoints, the vocabulary mapping (d2t/t2d), export, simulated and served evaluation, plots.

Imports eagle3's floor, gpu/, data/ and capture/ (the store it reads, the engine it serves with).
"""
