"""Copy a checkpoint's tensors into a built model: dense ones into their parameters (rows of a merged
projection, transposed for GPT-2's Conv1D), quantized ones into the packed modules that stage and
pack them (packing.py); then check that nothing is missing."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from engine.models.layers import MergedLinear
from engine.weights.packing import PackedLinear, packed_modules
from engine.weights.source import checkpoint_files


class WeightLoadError(ValueError):
    """The checkpoint does not fit the model: a missing tensor, an unexpected one, or a wrong shape."""


def iter_checkpoint(path: Path) -> Iterator[tuple[str, Tensor, str]]:
    """(name, tensor, file name) for every tensor of a (possibly sharded) safetensors checkpoint."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name), file.name


def load_weights(
    model: nn.Module, checkpoint: Path | Iterable[tuple[str, Tensor, str]], where: str | None = None
) -> None:
    """Copy every checkpoint tensor into its parameter (rows of a merged projection, transposed
    for GPT-2's Conv1D) and check that every parameter was filled. `checkpoint` is a safetensors
    folder, or (Hugging Face name, tensor, file name) triples from another format."""
    params = dict(model.named_parameters())
    packed = packed_modules(model)  # modules whose weight stays packed (engine/weights/packing.py)
    loaded: dict[str, set[int | None]] = {}
    arch = type(model).__name__
    if isinstance(checkpoint, (str, Path)):
        checkpoint, where = iter_checkpoint(Path(checkpoint)), where or str(checkpoint)
    for name, tensor, file in checkpoint:
        target = model.weight_target(name)
        if target is None:
            continue
        param_name, shard, transpose = target
        module_name, _, leaf = param_name.rpartition(".")
        if leaf == "weight" and module_name in packed:
            module = packed[module_name]
            try:
                module.load_shard(shard, tensor.t() if transpose and isinstance(tensor, Tensor) else tensor)
            except ValueError as e:
                raise WeightLoadError(f"tensor {name!r} in {file} does not fit {param_name}: {e}") from e
            if not module.missing_shards():
                module.finish()  # packed as soon as complete: the staged shards go at once
            continue
        param = params.get(param_name)
        if param is None:
            raise WeightLoadError(f"unexpected tensor {name!r} in {file}: {arch} has no parameter {param_name!r}")
        dst = param  # not .data: writing the parameter bumps its version, which cached packed copies check
        where = param_name
        if shard is not None:
            start, rows = _merged_module(model, param_name).shard_rows(shard)
            dst = dst.narrow(0, start, rows)
            where = f"{param_name} rows {start}:{start + rows}"
        src = tensor.t() if transpose else tensor
        if src.shape != dst.shape:
            raise WeightLoadError(
                f"tensor {name!r} in {file} has shape {tuple(tensor.shape)}"
                f"{' (transposed: ' + str(tuple(src.shape)) + ')' if transpose else ''}, "
                f"but {arch} expects {tuple(dst.shape)} for {where}"
            )
        with torch.no_grad():
            dst.copy_(src)
        loaded.setdefault(param_name, set()).add(shard)

    missing = []
    for param_name in params:
        module = _merged_module(model, param_name)
        if module is None:
            if param_name not in loaded:
                missing.append(param_name)
            continue
        # name the checkpoint tensors (q_proj, up_proj, ...) a merged parameter still lacks
        parts = param_name.split(".")
        split = {part: shard for part, (merged, shard) in getattr(model, "packed_modules", {}).items()
                 if merged == parts[-2]}
        if not split and param_name not in loaded:  # held whole by the checkpoint (Phi-3's qkv_proj)
            missing.append(param_name)
        for part, shard in split.items():
            if shard not in loaded.get(param_name, set()):
                missing.append(".".join([*parts[:-2], part, parts[-1]]))
    for module_name, module in packed.items():
        sizes = getattr(module, "output_sizes", [0])
        for shard in module.missing_shards():
            missing.append(f"{module_name}.weight" + (f" (shard {shard})" if len(sizes) > 1 else ""))
    if missing:
        raise WeightLoadError(
            f"checkpoint {where} lacks {len(missing)} tensor(s) that {arch} needs: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )
    for module in packed.values():
        module.finish()  # pack once; the staged shards are dropped


def _merged_module(model: nn.Module, param_name: str) -> MergedLinear | PackedLinear | None:
    module = model.get_submodule(param_name.rpartition(".")[0])
    if isinstance(module, PackedLinear) and len(module.output_sizes) > 1:  # its bias is merged too
        return module
    return module if isinstance(module, MergedLinear) else None
