"""Pure maths: no model, no I/O. Torch tensors or numpy arrays in, the same kind out.

Imports nothing from the rest of the package except the leaf validation module ``attnroll._checks``.
"""
