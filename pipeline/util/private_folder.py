"""Folders for code we build and load (the BLAS shim, pipeline's quantized kernels, MLX's compiled
CPU kernels): made without access for other users, and refused where another user could replace
what is in them. kernels/build.py (the shim and the extension) and private_tmp.py each keep their code in one.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def writable_by_others(st: os.stat_result) -> str:
    """Why another user could change a file or folder with this stat ("" if none can): it belongs
    to someone other than us or root, or its group or everyone may write to it."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"it belongs to user id {st.st_uid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "every user" if st.st_mode & stat.S_IWOTH else "its group"
        return f"{who} may write to it (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def unsafe_folder(folder: Path) -> str:
    """Why code in `folder` could be replaced by another user ("" if it cannot): the folder itself
    or a folder above it is theirs or writable by them. Above it, a sticky folder that others may
    write to (/tmp) is fine: they cannot rename or remove what is ours in it."""
    folder = Path(os.path.realpath(folder))
    for place in (folder, *folder.parents):
        try:
            st = os.stat(place)
        except FileNotFoundError:
            continue  # removed meanwhile: what is above it still counts
        why = writable_by_others(st)
        if why and not (place != folder and st.st_mode & stat.S_ISVTX and st.st_uid in (os.geteuid(), 0)):
            return f"{place}: {why}"
    return ""


def make_private_folder(folder: Path) -> None:
    """Create `folder` and any missing folders above it, none writable by group or others (a user
    private group's umask 002 would leave them group-writable and so refused)."""
    missing = []
    place = folder
    while not place.exists() and place != place.parent:
        missing.append(place)
        place = place.parent
    for place in reversed(missing):
        try:
            place.mkdir(mode=0o755)
        except FileExistsError:
            continue  # another rank made it first; its mode is checked like any other
        place.chmod(0o755)  # mkdir's mode is cut by the umask, never widened; chmod sets it exactly
