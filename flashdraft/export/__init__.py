"""Export: the serving formats of a trained drafter (docs/design.md §6), written, loaded, checked.

    flashdraft export CHECKPOINT --output DIR [--format dflash|speculators] [--verifier PATH]

Owns the `dflash` format (`dflash`: what vLLM, SGLang and z-lab's `dflash` load unchanged;
config.json <-> DrafterConfig, bf16 weights under bare names, loading ours and z-lab's
published drafters), vLLM's `speculators` layout (`speculators`, with the translation vLLM's
adapter applies to it), the config as the engines read it (`engine`: config.json re-read with
transformers' `AutoConfig`, compared field by field with the drafter), and an export in
either format (`artifact`: the options of `flashdraft export`, loading either format, and
writing with the reload check every export passes before it is reported as written). May
import `flashdraft.model` and the base layer (`config`, `storage`, `log`); never `data`,
`eval`, `train` or `commands`.

The public names are re-exported here, so callers write `from flashdraft.export import ...`.
"""

from flashdraft.export.artifact import (
    FORMATS,
    ExportConfig,
    ExportFormat,
    check_output,
    export_format,
    load_exported,
    save_export,
    verify_export,
)
from flashdraft.export.dflash import (
    ARCHITECTURE,
    SCALING,
    WEIGHTS,
    WEIGHTS_INDEX,
    from_serving_config,
    load_dflash,
    save_dflash,
    serving_state_dict,
    to_serving_config,
)
from flashdraft.export.engine import check_engine_config, engine_view, expected_engine_view
from flashdraft.export.speculators import (
    SPECULATORS_VERSION,
    check_speculators_config,
    from_speculators_config,
    save_speculators,
    to_speculators_config,
)

__all__ = [
    "ARCHITECTURE",
    "FORMATS",
    "SCALING",
    "SPECULATORS_VERSION",
    "WEIGHTS",
    "WEIGHTS_INDEX",
    "ExportConfig",
    "ExportFormat",
    "check_engine_config",
    "check_output",
    "check_speculators_config",
    "engine_view",
    "expected_engine_view",
    "export_format",
    "from_serving_config",
    "from_speculators_config",
    "load_dflash",
    "load_exported",
    "save_dflash",
    "save_export",
    "save_speculators",
    "serving_state_dict",
    "to_serving_config",
    "to_speculators_config",
    "verify_export",
]
