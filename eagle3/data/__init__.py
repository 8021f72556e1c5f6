"""What goes in: conversations (reading, tokenizing, splitting), the target's description
(config, shape, aux layer ids) and the builtin targets built locally.

Imports only eagle3's floor and gpu/.
"""
