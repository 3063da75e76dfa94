"""Streaming safetensors writer: model weights (ZeRO-3 partitioned, FSDP2 sharded or whole) as sharded safetensors,
one bounded group of parameters gathered at a time, tied parameters stored once, and a check after every save that
refuses empty, ``[0]``-shaped or missing tensors.

Every rank calls :func:`write_entries` under ZeRO-3 and FSDP (the gathers are collective); only the main rank writes
bytes, straight into the shard file, so the extra memory on it is one gather group and its collectives' staging (at
most about one shard, or ``gather_bytes`` if smaller, or twice the largest tensor), never the model.
"""

from __future__ import annotations

import json
import logging
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .. import atomic
from ..gather import full_values, is_sharded
from ..ranks import agree, shared_outcome
from ..runtime import trim_heap
from ..sizes import DEFAULT_MAX_SHARD_SIZE, parse_bytes

logger = logging.getLogger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_GATHER_BYTES = 256 * 2**20

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code

# ----------------------------------------------------------------------------------------------------------------
# what to write: one entry per stored tensor, in module order, tied parameters once
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class TensorEntry:
    """One tensor to store: its name, full shape and stored dtype, and the object that holds its values."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: torch.Tensor  # a parameter (possibly ZeRO-3 partitioned), a buffer or a plain tensor

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def sharded(self) -> bool:
        return is_sharded(self.source)


def tied_target_keys(model) -> set[str]:
    """Names that the model re-ties to another parameter when it loads (so they need not be stored)."""
    targets = getattr(model, "all_tied_weights_keys", None)
    if targets is None and hasattr(model, "get_expanded_tied_weights_keys"):
        try:
            targets = model.get_expanded_tied_weights_keys(all_submodels=True)
        except Exception:  # noqa: BLE001 - a model without tie information just stores everything
            targets = None
    return set(targets or ())


def _full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    shape = getattr(tensor, "ds_shape", None)  # ZeRO-3 keeps the full shape here; .shape is the empty partition
    return tuple(shape if shape is not None else tensor.shape)


def _dedupe(named: Iterable[tuple[str, torch.Tensor]], targets: set[str], dtype) -> list[TensorEntry]:
    """Entries in order; a tensor seen under several names is stored once, under a name the model does not re-tie."""
    groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
    order: list[int] = []
    for name, tensor in named:
        key = id(tensor)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append((name, tensor))
    entries = []
    for key in order:
        names = groups[key]
        keepers = [(n, t) for n, t in names if n not in targets]
        if not keepers:  # nobody declared the source: keep the first name
            keepers = names[:1]
        # names the model does not re-tie by itself are stored too, as copies (each name must load)
        for name, tensor in keepers:
            store = dtype if (dtype is not None and tensor.is_floating_point()) else tensor.dtype
            entries.append(TensorEntry(name, _full_shape(tensor), store, tensor))
    return entries


def model_entries(model, dtype: torch.dtype | None = None) -> list[TensorEntry]:
    """What ``model.state_dict()`` would hold, read from parameters and persistent buffers (ZeRO-3 aware)."""

    def named():
        for prefix, module in model.named_modules(remove_duplicate=False):
            dot = f"{prefix}." if prefix else ""
            for name, param in module.named_parameters(recurse=False):
                if param is not None:
                    yield dot + name, param
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and name not in module._non_persistent_buffers_set:
                    yield dot + name, buf

    seen: set[str] = set()
    unique = [(n, t) for n, t in named() if not (n in seen or seen.add(n))]
    return _dedupe(unique, tied_target_keys(model), dtype)


def state_dict_entries(state_dict: dict, model=None, dtype: torch.dtype | None = None) -> list[TensorEntry]:
    """Entries of a plain state dict (e.g. consolidated from a ZeRO checkpoint); shared tensors stored once."""
    return _dedupe(state_dict.items(), tied_target_keys(model) if model is not None else set(), dtype)


def plan_shards(entries: list[TensorEntry], max_shard_size: int) -> list[list[TensorEntry]]:
    """Consecutive entries packed into groups of at most ``max_shard_size`` bytes (a larger tensor gets its own):
    the shards of a save, and within a shard the groups gathered at once."""
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards if shards[0] else []


# ----------------------------------------------------------------------------------------------------------------
# the writer
# ----------------------------------------------------------------------------------------------------------------


def _header(shard: list[TensorEntry], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for entry in shard:
        header[entry.name] = {
            "dtype": _DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # tensor data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _write_tensor(f, entry: TensorEntry, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != entry.shape:
        raise RuntimeError(f"{entry.name}: gathered shape {tuple(tensor.shape)} differs from planned {entry.shape}")
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    tensor = tensor.to(entry.dtype).contiguous()
    if tensor.numel():
        f.write(memoryview(tensor.view(-1).view(torch.uint8).numpy()))


def shard_names(n_shards: int) -> list[str]:
    if n_shards == 1:
        return [SAFE_WEIGHTS_NAME]
    return [f"model-{i:05d}-of-{n_shards:05d}.safetensors" for i in range(1, n_shards + 1)]


def is_weight_file(name: str) -> bool:
    """A file name that holds (or indexes) a model's or an adapter's weights: a new save supersedes all of them."""
    return name in (
        SAFE_WEIGHTS_NAME,
        SAFE_WEIGHTS_INDEX_NAME,
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "adapter_model.safetensors",
        "adapter_model.bin",
    ) or bool(re.fullmatch(r"(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)", name))


def remove_weight_files(output_dir: str | Path) -> None:
    """Delete weight files of an earlier save so that loading cannot mix old and new shards."""
    for path in Path(output_dir).glob("*"):
        if path.is_file() and is_weight_file(path.name):
            path.unlink()


def write_entries(
    entries: list[TensorEntry],
    output_dir: str | Path,
    *,
    is_main: bool = True,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    gather_bytes: int | str = DEFAULT_GATHER_BYTES,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write ``entries`` as safetensors shards (+ index when more than one) into ``output_dir``, which should be a
    fresh directory (:mod:`hf_ext.atomic` stages one). Call on every rank under ZeRO-3 or FSDP.

    Non-main ranks only join the gathers. A write error on the main rank (a full disk) stops the writing but not the
    gathers the other ranks are in; when the entries are sharded (a collective call), every rank then raises
    (:func:`hf_ext.ranks.agree`). Returns the files written (empty on non-main ranks).
    """
    out = Path(output_dir)
    shard_limit = parse_bytes(max_shard_size)
    shards = plan_shards(entries, shard_limit)
    names = shard_names(len(shards))
    metadata = {"format": "pt", **(metadata or {})}
    # The extra memory of a save is bounded by the smaller of gather_bytes and the shard size. Gathering N bytes can
    # cost up to 2N while the collectives run (DeepSpeed allocates every gathered tensor up front, and gloo's
    # all-gather stages each output once more in a flat buffer of its own), so a group holds at most half of it; a
    # tensor larger than that is gathered alone.
    gather_limit = min(parse_bytes(gather_bytes), shard_limit) // 2
    error: BaseException | None = None  # the main rank's first write error; it keeps joining the gathers after it

    def on_main(step, *args):
        nonlocal error
        if is_main and error is None:
            try:
                return step(*args)
            except Exception as err:  # noqa: BLE001 - raised on every rank after the last gather
                error = err
        return None

    on_main(lambda: out.mkdir(parents=True, exist_ok=True))
    written = []
    for shard, name in zip(shards, names):
        f = on_main(open, out / name, "wb")
        if f is not None:
            on_main(f.write, _header(shard, metadata))
        try:
            for group in plan_shards(shard, gather_limit):
                with full_values([e.source for e in group]) as values:
                    if f is not None:
                        for entry, value in zip(group, values):
                            on_main(_write_tensor, f, entry, value)
                    del values
                if any(e.sharded for e in group):
                    # glibc keeps the released gather in its heaps unless told otherwise, and the next group does not
                    # always reuse it, so the resident set would grow towards the model's size shard after shard
                    trim_heap()
        finally:
            if f is not None:
                try:
                    f.close()
                except OSError as err:
                    error = error or err
        written.append(out / name)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {e.name: name for shard, name in zip(shards, names) for e in shard},
        }
        on_main((out / SAFE_WEIGHTS_INDEX_NAME).write_text, json.dumps(index, indent=2, sort_keys=True) + "\n")
        written.append(out / SAFE_WEIGHTS_INDEX_NAME)
    if any(e.sharded for e in entries):  # a collective call: every rank learns the outcome
        agree(f"writing the weights into {out}", error)
    if error is not None:
        raise error
    return written if is_main else []


def save_streaming(
    model,
    output_dir: str | Path,
    *,
    is_main: bool = True,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    gather_bytes: int | str = DEFAULT_GATHER_BYTES,
    dtype: torch.dtype | None = None,
) -> list[Path]:
    """Write ``model``'s weights (ZeRO-3 partitioned or not) as sharded safetensors, gathering a group at a time.

    Must be called on every rank when the model is ZeRO-3 partitioned. Values are the gathered parameters, cast to
    ``dtype`` when given (else stored in their own dtype). Tied parameters are stored once and re-tied on load.
    """
    with shared_outcome(f"preparing the save into {output_dir}"):
        staged = atomic.begin(output_dir) if is_main else atomic.staged_path(output_dir)
    try:
        write_entries(
            model_entries(model, dtype),
            staged,
            is_main=is_main,
            max_shard_size=max_shard_size,
            gather_bytes=gather_bytes,
        )
        with shared_outcome(f"saving the weights into {output_dir}"):
            if is_main:
                verify_saved_weights(staged, model)
                atomic.commit(output_dir, replaced=is_weight_file)
    except BaseException:
        if is_main:
            atomic.discard(output_dir)
        raise
    return sorted(p for p in Path(output_dir).iterdir() if is_weight_file(p.name)) if is_main else []


# ----------------------------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------------------------


def saved_weight_shapes(output_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every tensor in the safetensors weights of ``output_dir`` (headers only)."""
    out = Path(output_dir)
    index = out / SAFE_WEIGHTS_INDEX_NAME
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [SAFE_WEIGHTS_NAME]
    )
    shapes = {}
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def verify_saved_weights(output_dir: str | Path, model=None) -> dict[str, tuple[int, ...]]:
    """Raise if the saved weights hold an empty or ``[0]``-shaped tensor, or miss one of ``model``'s tensors.

    The offending weight files are removed first, so that an unusable save is never left behind to be loaded.
    """
    shapes = saved_weight_shapes(output_dir)
    problems = [f"{k} has shape {list(s)}" for k, s in shapes.items() if 0 in s]
    if model is not None:
        expected = {e.name: e.shape for e in model_entries(model)}
        problems += [f"{k} is missing" for k in expected if k not in shapes]
        problems += [
            f"{k} has shape {list(shapes[k])}, the model's is {list(s)}"
            for k, s in expected.items()
            if k in shapes and shapes[k] != s and 0 not in shapes[k]
        ]
    if problems:
        remove_weight_files(output_dir)
        raise RuntimeError(
            f"Refusing the weights saved in {output_dir}: {'; '.join(problems[:10])}"
            f"{' ...' if len(problems) > 10 else ''}. Under ZeRO-3 this means parameters were not gathered before "
            "saving; save with hf_ext.saving.writer.save_streaming (all ranks) or consolidate the ZeRO checkpoint."
        )
    return shapes
