"""Eval: the draft-and-verify decode loop (`speculative`) and the acceptance report built on
it (`evaluate`). May import `model`, `data` (to read and render prompts) and the base layer;
never `train` or `commands`.
"""
