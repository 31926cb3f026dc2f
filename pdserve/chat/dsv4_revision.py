"""Which revision of DeepSeek-V4's encoder (dsv4.REVISIONS) a checkpoint was trained with.

The V4-Flash-0731 refresh changed only the reasoning-effort texts; its config.json and
tokenizer_config.json are those of the original release (same architecture and model_type, the
tokenizer config byte for byte). What differs is the reference encoder DeepSeek ships beside the
weights, encoding/encoding_dsv4.py: the original defines one REASONING_EFFORT_MAX, 0731 a table
REASONING_EFFORT_PROMPTS. So `auto` reads that file (as text, never run), then the checkpoint's
name:

    encoding/encoding_dsv4.py defines REASONING_EFFORT_PROMPTS   -> 0731
    encoding/encoding_dsv4.py defines REASONING_EFFORT_MAX       -> original
    no such file (or neither name): the folder, its Hugging Face cache repo, or config.json's
    _name_or_path holds "0731"                                   -> 0731
    else                                                         -> original

A converted or renamed checkpoint without the file can name its revision instead (the router's
chat_encoder_revision).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pdserve.chat.dsv4 import REVISIONS

log = logging.getLogger(__name__)
SETTINGS = ("auto", *REVISIONS)
ENCODER_FILE = "encoding/encoding_dsv4.py"


def choose(setting: str, folder: str | Path) -> str:
    """The revision for `setting` (auto: detected in `folder`); ValueError for an unknown name."""
    if setting not in SETTINGS:
        raise ValueError(f"chat encoder revision must be one of {', '.join(SETTINGS)}, not {setting!r}")
    if setting != "auto":
        return setting
    revision, why = detect(Path(folder))
    log.info("DeepSeek-V4 chat encoder revision %s: %s", revision, why)
    return revision


def detect(folder: Path) -> tuple[str, str]:
    """(the checkpoint's revision, what told it)."""
    try:
        source = (folder / ENCODER_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        source = ""
    if "REASONING_EFFORT_PROMPTS" in source:
        return "0731", f"{ENCODER_FILE} has REASONING_EFFORT_PROMPTS"
    if "REASONING_EFFORT_MAX" in source:
        return "original", f"{ENCODER_FILE} has REASONING_EFFORT_MAX"
    for name in _names(folder):
        if "0731" in name:
            return "0731", f"the checkpoint is named {name!r}"
    return "original", f"no {ENCODER_FILE} and no name that says 0731"


def _names(folder: Path) -> list[str]:
    """The checkpoint's names: its folder, the repo of a Hugging Face cache snapshot
    (models--org--name/snapshots/<hash>), config.json's _name_or_path."""
    folder = folder.resolve()
    names = [folder.name]
    if folder.parent.name == "snapshots":
        names.append(folder.parent.parent.name)
    try:
        given = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        given = None
    if isinstance(given, str):
        names.append(given)
    return names
