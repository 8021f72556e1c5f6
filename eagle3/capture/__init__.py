"""What drives the target's engine: finding the decoder stack, the capture hooks, the vLLM and HF
sources, regeneration, extraction and the hidden-state store that extraction writes and training reads.

Imports eagle3's floor, gpu/ and data/.
"""
