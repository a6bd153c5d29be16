"""Content hashes of files, remembered by (path, size, mtime) so a rerun reads no file twice.

The cache is keyed by what files contain, not by their names; hashing a 10 GB text encoder or 50,000
photos on every run would cost minutes, so each hash is kept in a small JSON index in the cache folder.
A file whose size or modification time changed is hashed again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from zerotune.files import write_text_atomic


def digest(*parts: object) -> str:
    """A stable hex key for JSON-able parts (dict keys are sorted)."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


class FileHasher:
    def __init__(self, index_file: Path | None):
        self.index_file = index_file
        self._index: dict[str, list] = {}
        self._dirty = False
        if index_file is not None and index_file.is_file():
            try:
                self._index = json.loads(index_file.read_text())
            except ValueError:
                self._index = {}  # a damaged index only costs rehashing

    def file(self, path: Path) -> str:
        path = path.resolve()
        st = path.stat()
        key = str(path)
        hit = self._index.get(key)
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            return hit[2]
        with open(path, "rb") as f:
            value = hashlib.file_digest(f, "sha256").hexdigest()
        self._index[key] = [st.st_size, st.st_mtime_ns, value]
        self._dirty = True
        return value

    def folder(self, folder: Path) -> str:
        """One hash of every file in a folder (hidden ones aside), names included."""
        folder = folder.resolve()
        files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(folder).parts))
        return digest([(name, self.file(folder / name)) for name in files])

    def save(self) -> None:
        if self.index_file is None or not self._dirty:
            return
        self.index_file.parent.mkdir(parents=True, exist_ok=True)
        # Runs of a sweep may save at once: each writes a whole file and renames it, the last one wins.
        write_text_atomic(self.index_file, json.dumps(self._index))
        self._dirty = False
