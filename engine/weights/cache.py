"""The weight cache: a packed load's tensors saved once, so the next load of the same file maps them
instead of repacking (issue 28).

One safetensors file per (GGUF file, quantization, dtype, CPU kernels' variant, LAYOUT_VERSION) under
the cache root (gguf.cache_root's parent, "weights/"): every packed weight's tensors
(packed.BlockWeight.tensors) and every dense parameter, with a metadata header that repeats the key and
names each packed module's class and mode. The file is identified by its resolved path, size,
mtime and a hash of its first and last MiB, so a file rewritten in place misses.

A warm load maps the file (MAP_PRIVATE: pages are shared with every process mapping it, and a write
would copy a page, never change the file) and the model's tensors are views of the mapping, so the
weights are resident once per machine, as file pages the OS can drop and fault back. The tensors are
written by this module's own streaming writer (no second copy of the model in memory) in safetensors'
layout, packed tensors first and each a multiple of 32 bytes, so every packed tensor is 32-byte aligned
for the kernels. Written to a temporary file and renamed; on reading, the header (version, key), the
tensor set, shapes, dtypes and extent, the file size and a hash of each tensor's first and last 4 KiB
are checked: an entry that fails is deleted and rebuilt (one log line), never loaded.

The header also names the entry's source file (path, size, mtime) and variant, and the entry's mtime is
set again at each load: after each write and load, cache_entries.prune removes in the background the
entries no load can hit again and bounds the rest per source file (its docstring says which).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import secrets
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from engine.weights import cache_entries
from engine.weights.cache_entries import LAYOUT_VERSION, META, CacheMiss, read_header, source_stat
from engine.weights.packed import BlockWeight

_SAMPLE = 4096  # bytes hashed at each end of every tensor
_ALIGN = 64  # the data section starts here (the header is padded to it)
_DTYPES = {torch.uint8: "U8", torch.int8: "I8", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int32: "I32", torch.int64: "I64", torch.float64: "F64"}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
log = logging.getLogger(__name__)
_saving: list[threading.Thread] = []  # entries being written, or the folder pruned, in the background
_lock = threading.Lock()


def _file_identity(path: Path) -> tuple[str, dict[str, int | str]]:
    """The key's part for the file, and what the entry records of it (cache_entries.source_stat)."""
    source = source_stat(str(path.resolve()))
    digest = hashlib.sha256()
    with open(path, "rb") as f:  # the header (first MiB) and the tail: a rewrite with the same size and mtime misses
        digest.update(f.read(1 << 20))
        f.seek(max(0, int(source["size"]) - (1 << 20)))
        digest.update(f.read(1 << 20))
    return f"{source['path']}|{source['size']}|{source['mtime_ns']}|{digest.hexdigest()}", source


def _isa() -> str:
    from kernels.cpu import isa as cpu_isa

    try:
        return cpu_isa.choose().isa
    except ValueError:
        return "none"


class WeightCache:
    """The cache entry of one packed load of `path`: `load_into` a model built for it, or `save` it."""

    def __init__(self, path: Path, quantization: str, dtype: torch.dtype, root: Path) -> None:
        identity, self.source = _file_identity(path)
        self.variant = {"quantization": quantization, "dtype": str(dtype).removeprefix("torch."), "isa": _isa()}
        parts = [identity, quantization, str(dtype), self.variant["isa"], f"layout {LAYOUT_VERSION}"]
        self.key = hashlib.sha256("|".join(parts).encode()).hexdigest()
        self.file = root / f"{path.stem}-{self.key[:16]}.safetensors"

    @classmethod
    def for_file(cls, path: Path, quantization: str, dtype: torch.dtype) -> WeightCache | None:
        """The entry for loading `path` packed; None when caching is off (ROSECHAT_CACHE_DIR="")."""
        root = cache_entries.folder()
        return None if root is None else cls(path, quantization, dtype, root)

    # ------------------------------------------------------------------ reading
    def load_into(self, model: nn.Module) -> bool:
        """Fill `model` (packed modules swapped in, dense parameters allocated) from the entry: True if
        it did; False if there is none, or it failed a check (then it is deleted, with a log line)."""
        if not self.file.is_file():
            return False
        try:
            tensors, meta = self._read()
            _fill(model, tensors, meta)
        except (CacheMiss, OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            log.warning("weight cache %s is unusable (%s): rebuilding it", self.file.name, e)
            self.file.unlink(missing_ok=True)
            return False
        try:
            os.utime(self.file)  # used now: the pruning keeps the most recently used entries of a file
        except OSError:
            pass  # a read-only cache still maps
        _in_background(self._prune, "rosechat-weight-cache-prune")
        return True

    def _prune(self) -> None:
        """The other entries no load can hit again, and the least recently used of this file's variants
        (cache_entries.prune); never this one. Pruning failures only log: they cost disk, not a load."""
        try:
            cache_entries.prune(self.file.parent, keep=self.file)
        except Exception as e:  # on a background thread: a traceback there would tell the user nothing
            log.warning("could not prune the weight cache %s: %s", self.file.parent, e)

    def _read(self) -> tuple[dict[str, Tensor], dict]:
        size = self.file.stat().st_size
        with open(self.file, "rb") as f:
            start, header, meta = read_header(f, size)
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: shared pages, never written back
        if meta.get("version") != LAYOUT_VERSION or meta.get("key") != self.key:
            raise CacheMiss("another version or key")
        digest = hashlib.sha256()
        tensors = {}
        for name, info in header.items():
            begin, end = info["data_offsets"]
            dtype = _TORCH_DTYPES[info["dtype"]]
            count = (end - begin) // dtype.itemsize
            if count != _numel(info["shape"]):
                raise CacheMiss(f"{name}: {end - begin} bytes for shape {info['shape']}")
            digest.update(mapping[start + begin : start + min(end, begin + _SAMPLE)])
            digest.update(mapping[start + max(begin, end - _SAMPLE) : start + end])
            tensor = (torch.frombuffer(mapping, dtype=dtype, count=count, offset=start + begin) if count
                      else torch.empty(0, dtype=dtype))
            tensors[name] = tensor.view(info["shape"])
        if digest.hexdigest() != meta.get("sample"):
            raise CacheMiss("the data does not match its checksum")
        return tensors, meta

    # ------------------------------------------------------------------ writing
    def save(self, model: nn.Module, background: bool = True) -> None:
        """Write the entry for a packed model just loaded (atomically; a failure only logs). In the
        background by default: the tensors are only read, and the load need not wait for the disk
        (`wait_for_saves`; Python waits for the thread at exit)."""
        if background:
            _in_background(lambda: self._save(model), "rosechat-weight-cache")
        else:
            self._save(model)

    def _save(self, model: nn.Module) -> None:
        if self._write(model):
            self._prune()  # after the write: a failed one leaves the cache as it was

    def _write(self, model: nn.Module) -> bool:
        from engine.weights.packing import packed_modules

        packed = packed_modules(model)
        tensors: dict[str, Tensor] = {}
        modules = {}
        for name, module in packed.items():
            weight = module.weight
            if not isinstance(weight, BlockWeight) or not type(weight).names:
                return False  # torch's or the GPU's forms: not cached
            modules[name] = {"class": type(weight).__name__, "mode": weight.mode, "shape": list(weight.shape)}
            tensors.update({f"{name}.weight.{k}": t for k, t in weight.tensors().items()})
        params = dict(model.named_parameters())
        tensors.update(params)  # after the packed ones: their sizes keep the packed tensors aligned
        digest = hashlib.sha256()
        header: dict = {}
        offset = 0
        for name, t in tensors.items():
            data = _bytes(t)
            header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [offset, offset + len(data)]}
            digest.update(data[: _SAMPLE])
            digest.update(data[max(0, len(data) - _SAMPLE):])
            offset += len(data)
        meta = {"version": LAYOUT_VERSION, "key": self.key, "source": self.source, "variant": self.variant,
                "modules": modules, "params": sorted(params), "sample": digest.hexdigest()}
        header["__metadata__"] = {META: json.dumps(meta)}
        text = json.dumps(header).encode()
        text += b" " * (-(8 + len(text)) % _ALIGN)
        # a token per write (two saves of one entry in a process), the pid last (cache_entries._abandoned reads it)
        tmp = self.file.with_name(f"{self.file.name}.{secrets.token_hex(4)}.{os.getpid()}.tmp")
        try:  # anything that fails only costs the next load a repack
            self.file.parent.mkdir(parents=True, exist_ok=True)
            cache_entries.prune_abandoned(self.file)  # a killed writer's: its space, before this one takes more
            with open(tmp, "wb") as f:
                f.write(struct.pack("<Q", len(text)) + text)
                for t in tensors.values():
                    f.write(_bytes(t))
            os.replace(tmp, self.file)  # whole or not at all, also with two rosechats loading at once
        except Exception as e:
            tmp.unlink(missing_ok=True)
            log.warning("could not write the weight cache %s: %s", self.file, e)
            return False
        return True


def _in_background(work: Callable[[], None], name: str) -> None:
    """Run `work` on a thread wait_for_saves waits for (not a daemon: Python waits for it at exit, so
    an entry is never left half-written by the interpreter stopping)."""
    thread = threading.Thread(target=work, name=name, daemon=False)
    with _lock:
        _saving.append(thread)
    thread.start()


def wait_for_saves() -> None:
    """Wait until the entries being written in the background are on disk, and the pruning after each
    write or load has run (tests, benchmarks)."""
    with _lock:
        threads, _saving[:] = list(_saving), []
    for thread in threads:
        thread.join()


def _bytes(t: Tensor) -> memoryview:
    """A tensor's bytes without a copy."""
    return memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _classes() -> dict[str, type[BlockWeight]]:
    found, todo = {}, [BlockWeight]
    while todo:
        for sub in todo.pop().__subclasses__():
            found[sub.__name__] = sub
            todo.append(sub)
    return found


def _fill(model: nn.Module, tensors: dict[str, Tensor], meta: dict) -> None:
    """Put the cached tensors in place, checked against what the model expects first (nothing is changed
    unless everything fits)."""
    from engine.weights.packing import packed_modules

    packed = packed_modules(model)
    params = dict(model.named_parameters())
    if set(meta["modules"]) != set(packed) or set(meta["params"]) != set(params):
        raise CacheMiss("its modules are not the model's")
    classes, weights = _classes(), {}
    for name, module in packed.items():
        info = meta["modules"][name]
        cls = classes[info["class"]]
        shape = (module.out_features, module.in_features) if hasattr(module, "out_features") else (
            module.num_embeddings, module.embedding_dim)
        if info["mode"] != module.mode or tuple(info["shape"]) != shape:
            raise CacheMiss(f"{name} is not {module.mode} {shape}")
        with torch.device("meta"):
            want = cls.allocate(*shape).tensors()
        got = {k: tensors[f"{name}.weight.{k}"] for k in want}
        for k, t in got.items():
            if t.shape != want[k].shape or t.dtype != want[k].dtype:
                raise CacheMiss(f"{name}.weight.{k} is {t.dtype} {tuple(t.shape)}")
            if t.data_ptr() % 32:
                got[k] = t.clone()  # the kernels read 32-byte aligned blocks
        weights[name] = cls.from_tensors(shape, got)
    for name, param in params.items():
        if tensors[name].shape != param.shape or tensors[name].dtype != param.dtype:
            raise CacheMiss(f"{name} is {tensors[name].dtype} {tuple(tensors[name].shape)}")
    for name, module in packed.items():
        module.weight = weights[name]
    for name, param in params.items():
        param.data = tensors[name]  # a view of the mapping: no copy (parameters are only read)


__all__ = ["LAYOUT_VERSION", "WeightCache", "wait_for_saves"]
