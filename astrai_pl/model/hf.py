"""Read and write Hugging Face checkpoint directories: config.json + safetensors, sharded or not.

Supported `model_type`s: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe. Config
translation lives in hf_config.py, weight names in hf_keys.py; this module does the files.

RoPE layout. Rotary embedding pairs channel i with channel i + D/2 of each head ("rotate half":
x·cos + rotate_half(x)·sin). That is the layout of every Hugging Face checkpoint of these
architectures, and of layers.py, so q_proj/k_proj rows are copied verbatim both ways — no
permutation. Meta's original Llama release (`consolidated.*.pth`) and Mistral's
`consolidated.safetensors` use the *interleaved* layout instead (channel 2i paired with 2i+1);
transformers' conversion script permutes the q/k rows of each head to go from that layout to
rotate-half. Those files are not read here: point `from_pretrained` at the HF-format files.

Loading first reads only the safetensors headers and checks every key and shape against the model
config.json describes, so a bad checkpoint raises one typed error (see hf_config.py) naming the
file, the key and the fix, before any tensor is read. The model is built on the meta device, then
each shard's tensors are read and assigned shard by shard; a tensor with NaN/inf values (as stored, or
once cast) is refused, naming the file and the tensor. `dtype=None` loads in torch's default
dtype (float32: what training wants); pass e.g. torch.bfloat16 for inference.

generation_config.json lists as `eos_token_id` the model's end ids and, when a tokenizer is saved with
it, the tokenizer's end-of-turn ids (see Tokenizer.eos_token_ids), so `transformers` and vLLM stop
where a chat turn ends.

Saving refuses NaN/inf weights and, into an existing folder, overwriting a file that no export wrote
(export_manifest.py; `overwrite=True` allows it; other files are kept); it writes the hidden `.NAME.partial` beside the target (config.json last, so
a folder holding it is complete) and moves it into place with astrai_pl/atomic.py's `replace_path`: a kill
at any moment leaves a complete export, under its name or beside it, which loading reads and the next save
puts back.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..atomic import interrupted_copy, partial_path, recover_interrupted_replace, remove_path, replace_path
from .config import ModelConfig
from .export_manifest import check_overwrite, write_manifest
from .hf_config import (
    CheckpointError,
    CheckpointNotFoundError,
    ExportError,
    MissingWeightError,
    NonFiniteWeightError,
    UnexpectedWeightError,
    UnsupportedCheckpointError,
    WeightShapeError,
    check_exportable,
    config_from_hf,
    config_to_hf,
    generation_config,
)
from .hf_keys import Source, export_tensors, hf_name, is_ignored, sources_for
from .layers import RotaryEmbedding, rope_frequencies

__all__ = ["CheckpointError", "CheckpointNotFoundError", "ExportError", "MissingWeightError",
           "NonFiniteWeightError", "UnexpectedWeightError", "UnsupportedCheckpointError", "WeightShapeError",
           "export_dir", "load_pretrained", "nonfinite_tensors", "read_config", "save_pretrained"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_LISTED = 5


# -- reading ----------------------------------------------------------------------------------------------
def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise CheckpointNotFoundError(f"{file} does not exist. Fix: point at a Hugging Face model directory "
                                      f"(it holds config.json and {SINGLE_FILE} or {INDEX_FILE}).")
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, nested too deeply, an over-long integer
        raise CheckpointError(f"{file} is not valid JSON ({type(err).__name__}: {str(err)[:200]}). Fix: "
                              "re-download or re-export it.") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file} holds a JSON {type(value).__name__}, not an object. Fix: re-download or "
                              "re-export it (transformers writes one object of key: value pairs).")
    return value


def is_complete_export(folder: Path) -> bool:
    """config.json is the last file save_pretrained writes."""
    return (folder / "config.json").is_file()


def export_dir(path: str | Path) -> Path:
    """`path`, or the complete export beside it that a save cut off between two renames left instead."""
    return interrupted_copy(Path(path), is_complete_export) or Path(path)


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face model directory, without touching its weights."""
    root = export_dir(path)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{root} is not a directory. Fix: pass the folder that holds config.json "
                                      "and the safetensors files (download it first for a hub model).")
    return config_from_hf(_read_json(root / "config.json"), root / "config.json")


def weight_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, or model.safetensors."""
    if (root / INDEX_FILE).is_file():
        weight_map = _read_json(root / INDEX_FILE).get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v == Path(v).name
                                                       for v in weight_map.values()):
            raise CheckpointError(f"{root / INDEX_FILE}: 'weight_map' must map each tensor name to a shard file "
                                  "name. Fix: re-download or re-export the checkpoint.")
        names = sorted(set(weight_map.values()))
        for name in names:
            if not (root / name).is_file():
                raise CheckpointNotFoundError(f"{root / INDEX_FILE} names shard {name!r}, which does not exist. "
                                              "Fix: download the missing shard.")
        return [root / name for name in names]
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    found = sorted(p.name for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".pth"))
    raise CheckpointNotFoundError(
        f"{root} has neither {SINGLE_FILE} nor {INDEX_FILE} (found: {found or 'no weight files'}). Fix: "
        "use the Hugging Face safetensors files; convert .bin/.pth weights with transformers first.")


def _open(file: Path):
    try:
        return safe_open(file, framework="pt")
    except SafetensorError as err:
        raise CheckpointError(f"{file} is not a readable safetensors file ({err}). Fix: re-download or "
                              "re-export it.") from err


def _listed(items: list[str]) -> str:
    more = f" (and {len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else ""
    return ", ".join(items[:_MAX_LISTED]) + more


def plan_weights(files: list[Path], cfg: ModelConfig, expected: dict[str, tuple[int, ...]]) -> dict[str, Source]:
    """Map every expected state_dict key to its Source, reading only headers; raise on any mismatch."""
    sources: dict[str, Source] = {}
    unexpected: list[str] = []
    for file in files:
        with _open(file) as f:
            for hf_key in f.keys():
                if is_ignored(hf_key):
                    continue
                shape = tuple(f.get_slice(hf_key).get_shape())
                for key, source in sources_for(file, hf_key, shape, cfg.model_type, cfg).items():
                    if key == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue  # shared with embed_tokens; transformers ignores it too
                    if key not in expected:
                        unexpected.append(f"{file.name}: {hf_key!r}")
                        break
                    sources[key] = source
    _check_plan(files, cfg, expected, sources, unexpected)
    return sources


def _check_plan(files: list[Path], cfg: ModelConfig, expected: dict[str, tuple[int, ...]],
                sources: dict[str, Source], unexpected: list[str]) -> None:
    where = files[0].parent / (INDEX_FILE if len(files) > 1 or files[0].name != SINGLE_FILE else SINGLE_FILE)
    missing = list(dict.fromkeys(repr(hf_name(k, cfg.model_type)) for k in expected if k not in sources))
    if missing:
        raise MissingWeightError(
            f"{where}: {len(missing)} weight(s) that config.json requires are missing: {_listed(missing)}. Fix: "
            "make config.json match the weights (num_hidden_layers, num_experts, attention_bias, "
            "tie_word_embeddings: true if the output layer shares the embeddings) or re-export the checkpoint.")
    if unexpected:
        raise UnexpectedWeightError(
            f"{where.parent}: {len(unexpected)} weight(s) have no place in a {cfg.model_type} model with this "
            f"config.json: {_listed(unexpected)}. Fix: check model_type and the layer/expert counts in "
            "config.json, or remove the extra tensors.")
    bad = [f"{s.file.name}: {s.key!r} gives {s.shape}, expected {expected[k]}"
           for k, s in sources.items() if s.shape != expected[k]]
    if bad:
        raise WeightShapeError(
            f"{where.parent}: {len(bad)} weight(s) have the wrong shape: {_listed(bad)}. Fix: make config.json "
            "match the weights (vocab_size, hidden_size, intermediate_size, head counts, head_dim).")


def nonfinite_tensors(named: Iterable[tuple[str, Any]]) -> list[str]:
    """The names of the float tensors in `named` holding a NaN or ±inf (this process's shard of a DTensor)."""
    tensors = [(name, t.to_local() if hasattr(t, "to_local") else t) for name, t in named
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        return []
    finite = torch.stack([torch.isfinite(t).all().to(tensors[0][1].device) for _, t in tensors]).tolist()
    return [name for (name, _), ok in zip(tensors, finite) if not ok]


def _check_finite(file: Path, hf_key: str, tensor: torch.Tensor, cast: bool = False) -> None:
    """Refuse a tensor with NaN/inf values: as stored, or (`cast`) once cast to the load dtype."""
    finite = tensor.isfinite()
    if finite.all():
        return
    if cast:
        raise NonFiniteWeightError(
            f"{file}: tensor {hf_key!r} overflows {tensor.dtype} when loaded. Fix: load it in a wider dtype "
            "(e.g. dtype=torch.bfloat16 or torch.float32).")
    raise NonFiniteWeightError(
        f"{file}: tensor {hf_key!r} holds {int((~finite).sum())} NaN/inf value(s) of {tensor.numel()}. Fix: the "
        "file is damaged or was saved after training diverged; re-download it or export an earlier checkpoint.")


def _read_tensors(sources: dict[str, Source], dtype: torch.dtype,
                  transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Read every planned tensor, one shard open at a time, cast to `dtype`; NaN/inf values are refused. Each is
    passed through `transform(key, tensor)` as soon as it is read and checked, before the next is read."""
    by_file: dict[Path, list[tuple[str, Source]]] = defaultdict(list)
    for key, source in sources.items():
        by_file[source.file].append((key, source))
    state: dict[str, torch.Tensor] = {}
    for file, items in by_file.items():
        with _open(file) as f:
            cache: dict[str, torch.Tensor] = {}  # a fused expert tensor serves many keys
            for key, source in sorted(items, key=lambda item: item[1].key):
                if source.key not in cache:
                    cache = {source.key: f.get_tensor(source.key)}
                    _check_finite(file, source.key, cache[source.key])
                tensor = source.take(cache[source.key]).to(dtype)
                if tensor.dtype != cache[source.key].dtype:
                    _check_finite(file, source.key, tensor, cast=True)
                state[key] = tensor if transform is None else transform(key, tensor)
    return state


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.get_default_dtype()
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a floating-point torch dtype. Fix: pass e.g. torch.bfloat16.")
    return resolved


def load_pretrained(cls: type[torch.nn.Module], path: str | Path, dtype: torch.dtype | str | None = None,
                    transform: Callable[[str, torch.Tensor, torch.nn.Module], torch.Tensor] | None = None):
    """Build `cls(config)` from a Hugging Face directory; every key and shape is checked before any is read.
    `transform(key, tensor, owner)` (owner: the module the tensor belongs to) replaces each tensor as soon as it
    is read (nf4.quantize_on_load: a linear weight is held in the load dtype only until it is quantised, so a
    QLoRA base never exists in full precision; a fused MoE tensor of the file, until its last expert is)."""
    root, target = export_dir(path), _resolve_dtype(dtype)
    cfg = read_config(root)
    cfg.torch_dtype = str(target).removeprefix("torch.")
    with torch.device("meta"):
        model = cls(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()
                if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
    sources = plan_weights(weight_files(root), cfg, expected)
    per_key = None if transform is None else (
        lambda key, tensor: transform(key, tensor, model.get_submodule(key.rpartition(".")[0])))
    model.load_state_dict(_read_tensors(sources, target, per_key), strict=False, assign=True)
    for module in model.modules():  # non-persistent buffers are not in the checkpoint: recompute
        if isinstance(module, RotaryEmbedding):
            module.register_buffer("inv_freq", rope_frequencies(module.cfg)[0], persistent=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()]), "a tensor was left unloaded"
    return model


# -- writing ----------------------------------------------------------------------------------------------
def _shard(tensors: list[tuple[str, torch.Tensor]], max_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into shards of at most max_bytes (a bigger tensor gets a shard of its own)."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for key, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, tensor))
        size += nbytes
    return shards


def _write_json(file: Path, obj: dict[str, Any]) -> None:
    file.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _weight_names(count: int) -> list[str]:
    return [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _write_weights(folder: Path, shards: list[list[tuple[str, torch.Tensor]]], names: list[str]) -> None:
    weight_map, total = {}, 0
    for name, shard in zip(names, shards):
        data = {key: t.detach().to("cpu").contiguous() for key, t in shard}
        save_file(data, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(data, name))
        total += sum(t.numel() * t.element_size() for t in data.values())
    if len(shards) > 1:
        _write_json(folder / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _is_weight_file(name: str) -> bool:
    return name == INDEX_FILE or (name.startswith("model") and name.endswith(".safetensors"))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry_over(old: Path, new: Path, left_out: set[str]) -> None:
    """Bring the old directory's other files (README, the user's own, ...) into the new one, except the names in
    `left_out`: those the export writes (config.json among them) and those a previous export wrote."""
    for entry in old.iterdir():
        if (new / entry.name).exists() or entry.name in left_out:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, copy_function=_link_or_copy, symlinks=True)
        elif entry.is_symlink():
            os.symlink(os.readlink(entry), new / entry.name)
        else:
            _link_or_copy(str(entry), str(new / entry.name))


def save_pretrained(model: torch.nn.Module, path: str | Path, tokenizer: Any = None,
                    max_shard_size: int = 2 * 1024**3, overwrite: bool = False) -> None:
    """Write config.json, generation_config.json, safetensors (sharded above max_shard_size bytes) and,
    if given, the tokenizer's files: a directory `transformers.AutoModelForCausalLM` loads. Into an existing
    folder: the files a previous export wrote are replaced, every other file is kept, and a file this export
    would overwrite that no export wrote (the user's config.json, weights from elsewhere) is refused with
    ExportConflictError unless `overwrite` (export_manifest.py)."""
    cfg: ModelConfig = model.config
    check_exportable(cfg)
    if max_shard_size <= 0:
        raise ValueError(f"max_shard_size={max_shard_size} must be positive. Fix: pass a size in bytes, e.g. 2**30.")
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory. Fix: pass a directory path.")
    target.parent.mkdir(parents=True, exist_ok=True)
    tensors = list(export_tensors(model, cfg))
    bad = nonfinite_tensors(tensors)
    if bad:
        raise NonFiniteWeightError(
            f"{target}: not written, because weight(s) {_listed(bad)} hold NaN or infinite values. Fix: export a "
            "checkpoint from before training diverged.")
    recover_interrupted_replace(target, is_complete_export)
    work = partial_path(target)
    remove_path(work)  # left by a save killed while writing it
    work.mkdir()
    try:
        _write_files(work, target, tensors, tokenizer, cfg, max_shard_size, overwrite)
        replace_path(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """The tokenizer's files; ours with its BOS in the chat template (Tokenizer.exported_chat_template), so that
    transformers and vLLM template a prompt into the ids our engine gives the model. Any other tokenizer object
    (e.g. a transformers one) is saved as it saves itself."""
    if hasattr(tokenizer, "exported_chat_template"):
        tokenizer.save_pretrained(str(folder), bos_in_template=True)
    else:
        tokenizer.save_pretrained(str(folder))


def _write_files(work: Path, target: Path, tensors: list[tuple[str, torch.Tensor]], tokenizer: Any,
                 cfg: ModelConfig, max_shard_size: int, overwrite: bool) -> None:
    """Everything of an export into `work`, config.json last (its presence marks the folder complete), then the
    manifest of what it wrote; what `target` holds besides is checked first and carried over."""
    end_ids = list(getattr(tokenizer, "eos_token_ids", None) or [])
    _write_json(work / "generation_config.json", generation_config(cfg, end_ids))
    if tokenizer is not None:
        save_tokenizer(tokenizer, work)
    shards = _shard(tensors, max_shard_size)
    weights = _weight_names(len(shards))
    writes = {p.name for p in work.iterdir()} | set(weights) | {"config.json"} | ({INDEX_FILE} if len(shards) > 1 else set())
    left_out = check_overwrite(target, writes, overwrite, {SINGLE_FILE, INDEX_FILE}, _is_weight_file)
    _write_weights(work, shards, weights)
    if target.is_dir():
        _carry_over(target, work, left_out | writes)
    dtype = str(tensors[0][1].dtype).removeprefix("torch.")
    _write_json(work / "config.json", config_to_hf(cfg, dtype))
    write_manifest(work, writes)
