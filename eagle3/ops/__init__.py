"""Operations around runs: publishing a draft to the registry, the nightly increments, run summaries.

The top room: may import every other part of eagle3, including the stage entry points.
"""
