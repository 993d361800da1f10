"""Where a model comes from: a local folder or a Hugging Face id, with one-line errors.

transformers takes any string that is not an existing folder for a hub id, so a mistyped
local path surfaces as a traceback about repo-id syntax ("Repo id must be in the form ...")
or about the network. `model_errors` checks the path first and turns what transformers
raises while loading into one line that names the option, the path and what to do.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

# What huggingface_hub accepts as a repo id: `name` or `namespace/name`.
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")
_FIX = "give the folder that holds the model's config.json and weights, or a Hugging Face id"


def check_model_path(path: str, key: str = "target") -> None:
    """FileNotFoundError (one line) when `path` can be neither a model folder nor a hub id:
    an existing file or folder without config.json, or a path that does not exist and is
    not spelled like an id (`org/name`)."""
    if "://" in path:
        return  # a remote URL: transformers says what it makes of it
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise FileNotFoundError(
                f"{key} {path!r} is not a model folder (no config.json); {_FIX}"
            )
        return
    if os.path.exists(local):
        raise FileNotFoundError(f"{key} {path!r} is a file, not a model folder; {_FIX}")
    if not _REPO_ID.match(path) or path.startswith((".", "~")):
        raise FileNotFoundError(f"{key} {path!r} does not exist; {_FIX}")


@contextmanager
def model_errors(path: str, key: str = "target") -> Iterator[None]:
    """Check `path` (`check_model_path`), then turn an OSError that transformers raises
    while loading from it (an unknown or unreachable hub id, a folder without weights) into
    one FileNotFoundError line naming `key` and `path`."""
    check_model_path(path, key)
    try:
        yield
    except OSError as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        reason = reason if len(reason) <= 200 else reason[:197] + "..."
        where = "a local folder" if os.path.isdir(os.path.expanduser(path)) else "a hub id"
        raise FileNotFoundError(
            f"{key} {path!r} could not be loaded as {where} ({reason}); check the spelling, "
            f"or download the model and give its folder"
        ) from None
