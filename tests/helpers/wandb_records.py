"""Read a W&B offline run back from its .wandb file, to check what a run logged (wandb has no reader API
for offline runs; the record format is its LevelDB-style log of protobuf records)."""

from __future__ import annotations

import glob
import json
import os
import struct
import time
import zlib
from collections.abc import Iterator
from typing import Any

# --------------------------------------------------------------------------- reading offline runs back
# The .wandb file is a LevelDB-style log (github.com/google/leveldb/blob/main/doc/log_format.md): a 7-byte
# header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each `crc32 u32 | length u16 |
# type u8 | data`; the CRC (plain IEEE, unmasked) covers the type byte and data. Records spanning blocks are
# split FIRST/MIDDLE.../LAST. Each record is a serialized wandb_internal_pb2.Record. wandb >= 0.2x writes
# these from its Go core and no longer ships the Python DataStore reader, hence this small one.
_HEADER = struct.Struct("<4sHB")
_CHUNK = struct.Struct("<IHB")
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def iter_wandb_records(path: str | os.PathLike[str]) -> Iterator[bytes]:
    """Serialized records of a .wandb file, in order. A torn final record (run still writing) is dropped."""
    with open(path, "rb") as f:
        data = f.read()
    ident, magic, version = _HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1 or version != 0:
        raise ValueError(f"{path}: not a W&B v0 log (header {ident!r} {magic:#x} {version})")
    pos, pending = _HEADER.size, None
    while pos + _CHUNK.size <= len(data):
        if _BLOCK - pos % _BLOCK < _CHUNK.size:  # block trailer: zero padding
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = _CHUNK.unpack_from(data, pos)
        chunk = data[pos + _CHUNK.size : pos + _CHUNK.size + length]
        pos += _CHUNK.size + length
        if kind == 0 and length == 0:  # preallocated/zeroed tail
            break
        if len(chunk) < length:
            break
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            raise ValueError(f"{path}: bad checksum at offset {pos - length - _CHUNK.size}")
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind in (_MIDDLE, _LAST) and pending is not None:
            pending += chunk
            if kind == _LAST:
                yield pending
                pending = None
        else:
            raise ValueError(f"{path}: unexpected chunk type {kind}")


def _item_path(item: Any) -> list[str]:
    # Items carry either a flat `key` or a `nested_key` path: wandb 0.2x+ uses nested_key in history and
    # splits dict values (e.g. a wandb.Image's descriptor) into one item per leaf.
    return list(item.nested_key) if item.nested_key else [item.key]


def _set(d: dict[str, Any], item: Any) -> None:
    *parents, leaf = _item_path(item)
    for p in parents:
        d = d.setdefault(p, {})
    d[leaf] = json.loads(item.value_json)


def _remove(d: dict[str, Any], item: Any) -> None:
    *parents, leaf = _item_path(item)
    for p in parents:
        d = d.get(p, {})
    d.pop(leaf, None)


def find_offline_run(run_dir: str | os.PathLike[str]) -> str:
    """The newest run-*.wandb under run_dir/wandb/offline-run-*/."""
    files = glob.glob(os.path.join(os.fspath(run_dir), "wandb", "offline-run-*", "run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no offline W&B run under {run_dir}/wandb/")
    return max(files, key=os.path.getmtime)


def read_offline_run(run_dir: str | os.PathLike[str], timeout_s: float = 15.0) -> dict[str, Any]:
    """Reads back an offline run: run metadata, config, history rows, final summary and exit code.

    `run.finish()` returns before wandb-core has written the file out (it may still hold only the 7-byte
    header), so this re-reads until the exit record is there or `timeout_s` passes; a run that never
    finished (crash, still running) is returned as far as it got, with exit_code None.

    Values are JSON-decoded (an integral float comes back as an int: wandb 0.31 stores 100.0 as "100");
    images appear as wandb's descriptors (`{"_type": "images/separated", "filenames": [...], ...}`).
    """
    path = find_offline_run(run_dir)
    deadline = time.monotonic() + timeout_s
    while True:
        run = _parse_run(path)
        if run["exit_code"] is not None or time.monotonic() >= deadline:
            return run
        time.sleep(0.05)


def _parse_run(path: str) -> dict[str, Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    out: dict[str, Any] = {"path": path, "config": {}, "history": [], "summary": {}, "exit_code": None}
    for raw in iter_wandb_records(path):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            out.update(run_id=r.run_id, project=r.project, entity=r.entity, name=r.display_name,
                       group=r.run_group, tags=list(r.tags))
            _apply_config(out["config"], r.config)
        elif kind == "config":
            _apply_config(out["config"], rec.config)
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in rec.history.item:
                _set(row, item)
            out["history"].append(row)
        elif kind == "summary":
            for item in rec.summary.update:
                _set(out["summary"], item)
            for item in rec.summary.remove:
                _remove(out["summary"], item)
        elif kind == "exit":
            out["exit_code"] = rec.exit.exit_code
    out["config"].pop("_wandb", None)  # wandb's own bookkeeping
    out["summary"].pop("_wandb", None)
    return out


def _apply_config(config: dict[str, Any], record: Any) -> None:
    for item in record.update:
        _set(config, item)
    for item in record.remove:
        _remove(config, item)
