"""The online feed (train.data online/hybrid): the target's hidden states captured while the draft trains, through a
bounded buffer instead of a complete store (feed.py), a capture worker in another process or machine (remote.py,
capture_worker.py).

May import eagle3's floor, gpu/, data/, capture/, engine/, draft/ and evaluate/; never train/ (which reads this feed)
or the stage modules (tests/test_layering.py).
"""
