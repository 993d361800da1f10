"""Applied from outside the model code, in one fixed order: compile, then distribution.

Model code stays single-device (STYLE); everything that wraps or transforms a module for
speed or scale lives here.
"""

from __future__ import annotations

from flashdraft.drafter import DFlashDrafter


def compile_drafter(drafter: DFlashDrafter) -> DFlashDrafter:
    """Compile each decoder layer in place (`Module.compile`), so parameter names, state
    dicts and checkpoints are untouched (no `_orig_mod.` prefixes anywhere)."""
    for layer in drafter.layers:
        layer.compile(dynamic=False)
    drafter.hidden_norm.compile(dynamic=False)
    return drafter
