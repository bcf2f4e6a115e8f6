"""The embedded default model: what ``tandem generate`` loads when no model directory is given.

The trained demo checkpoint ships inside the package (``ranks/demo_model/``, see docs/demo-model.md).
If it is missing (a stripped install), a seeded random checkpoint of the ``tiny`` preset stands in,
built once into the user's cache directory (``$TANDEM_CACHE_DIR``, else ``$XDG_CACHE_HOME/tandem``,
else ``~/.cache/tandem``); it talks nonsense, but it exercises the whole path.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

log = logging.getLogger(__name__)

PACKAGED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")
STAND_IN = "random-tiny-seed0-v1"


def cache_dir() -> str:
    root = os.environ.get("TANDEM_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem")
    return root


def default_model_dir() -> str:
    """The packaged demo model if present, else the random stand-in (built on first use)."""
    if os.path.isfile(os.path.join(PACKAGED_DIR, "config.json")):
        return PACKAGED_DIR
    target = os.path.join(cache_dir(), "models", STAND_IN)
    if os.path.isfile(os.path.join(target, "config.json")):
        return target
    from ranks.random_checkpoint import write_random_checkpoint

    log.warning("the packaged demo model is missing; building a random 'tiny' checkpoint in %s", target)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=STAND_IN + ".", dir=os.path.dirname(target))
    try:
        write_random_checkpoint(tmp, "tiny", seed=0, dtype="float32", layout="official", progress=False)
        try:
            os.rename(tmp, target)            # atomic: a concurrent builder loses the race harmlessly
        except OSError:
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
