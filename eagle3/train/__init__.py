"""Training the draft: its settings (config.py, train.*), the loss, the optimizers, the training loop with
training-time test and resume (trainer.py), and several processes or machines through torchrun (ddp.py, launch.py).

May import every room below it: eagle3's floor, gpu/, data/, capture/, engine/, draft/, evaluate/ (checkpoints are
scored by acceptance) and online/ (the feed it trains from); never the stage modules (tests/test_layering.py).
"""
