"""RWKV state files: one state (and its next-token logits) in safetensors, checked field by field on load.

A file holds five (layers, hidden) tensors — ffn_shift, att_shift, aa, bb, pp, in rwkv.py's layout — and,
when the state has seen a token, last_logits (vocab,) float32. Its header names the format, the layout
version, the model fingerprint (`sessions.model_fingerprint`), the dtype and the token count (20 digits, so
the header's length does not vary). Nothing grows with the context: a state after 10 tokens and one after
2,000 take the same bytes. An engine session's file (`Session.save` on an RWKV engine) also holds its
token_ids (tokens,) int64, which it needs to compute its history again after it expired or a turn failed;
its token count is then the tokens computed into the state (the last reply token may not be).

Compression (dtype float16 or bfloat16): the shifts and aa, bb are stored in that dtype, pp always in
float32 — an exponent rounded to float16 (10 bits) would scale a and b by up to e^{|pp|/2048}, and the empty
marker −1e38 is no float16 at all. Before rounding, each channel is renormalised so that bb = 1: pp absorbs
ln bb (in float32) and aa becomes a/b, the decayed mean of past values, bounded by max |v|, so it neither
overflows float16 nor loses more than that dtype's relative precision. float32 files store the state as
it is, bit for bit.

A file is untrusted: the header, every tensor's dtype and shape (read before its data) and every value are
checked, and a refusal is a SessionError naming the file and the field. Nothing in a file executes code.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from ...atomic import write_atomically
from ...model.rwkv import NO_EXPONENT, LayerState
from ..sessions import SessionError

FORMAT = "astrai_pl.rwkv_state"
VERSION = "1"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_FILE_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
NAMES = LayerState._fields  # ffn_shift, att_shift, aa, bb, pp


def dtype_name(dtype) -> str:
    names = {v: k for k, v in DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"dtype={dtype!r}: a state is saved as torch.float32, torch.float16 or torch.bfloat16")
    return names[dtype]


def compressible(layer: LayerState) -> LayerState:
    """The same state with bb = 1 wherever a token was seen (pp += ln bb, aa /= bb): see the module docstring."""
    seen = layer.bb > 0
    bb = torch.where(seen, layer.bb, torch.ones_like(layer.bb))
    return layer._replace(aa=layer.aa / bb, bb=torch.where(seen, torch.ones_like(bb), layer.bb),
                          pp=torch.where(seen, layer.pp + torch.log(bb), layer.pp))


def write_state(path, layers: list[LayerState], last_logits, fingerprint: str, tokens: int, dtype,
                token_ids: list[int] | None = None) -> None:
    """Write `layers` (one row each) atomically; `dtype` compresses as the module docstring says."""
    name = dtype_name(dtype)
    if dtype != torch.float32:
        layers = [compressible(layer) for layer in layers]
    stacked = {n: torch.cat([getattr(layer, n) for layer in layers]).float().cpu() for n in NAMES}
    tensors = {n: (t if n == "pp" else t.to(dtype)).contiguous() for n, t in stacked.items()}
    for n, t in tensors.items():
        if not torch.isfinite(t).all():
            raise SessionError(f"{path}: the state's {n} is not finite in {name} (its range is too small for "
                               "these values); save with dtype=torch.float32 or torch.bfloat16")
    if last_logits is not None:
        tensors["last_logits"] = last_logits.float().cpu().contiguous()
    if token_ids is not None:
        tensors["token_ids"] = torch.tensor(token_ids, dtype=torch.int64)
    layers_count, hidden = stacked["pp"].shape
    metadata = {"format": FORMAT, "version": VERSION, "fingerprint": fingerprint, "dtype": name,
                "tokens": f"{tokens:020d}", "layers": str(layers_count), "hidden": str(hidden)}
    data = save(tensors, metadata=metadata)
    write_atomically(Path(path), lambda f: f.write(data))


def read_state(path, fingerprint: str, num_layers: int, hidden: int, vocab: int, with_token_ids: bool = False):
    """(one-row float32 LayerStates, last_logits or None, token count) from a file written by `write_state` for
    this model, and with `with_token_ids` the file's token_ids (int64, at least the token count of them);
    SessionError otherwise."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tokens, dtype = _check_header(path, metadata, fingerprint, num_layers, hidden)
            names = set(f.keys())
            allowed = {*NAMES, "last_logits", "token_ids"}
            if not set(NAMES) <= names <= allowed or ("last_logits" in names and not tokens):
                raise _refuse(path, "tensors", f"are {sorted(names)}, a state has {list(NAMES)} and, after a token, "
                              "maybe last_logits (and an engine session's token_ids)")
            ids = _token_ids(path, f, tokens) if "token_ids" in names else None
            if with_token_ids and ids is None:
                raise SessionError(f"{path} holds a state without token ids (StateSession.save writes those); "
                                   "load it with StateSession.load, or save the engine session with Session.save")
            names.discard("token_ids")
            for name in sorted(names):
                expected = (torch.float32, (vocab,)) if name == "last_logits" else (
                    torch.float32 if name == "pp" else dtype, (num_layers, hidden))
                piece = f.get_slice(name)
                found = (_FILE_DTYPES.get(piece.get_dtype()), tuple(piece.get_shape()))
                if found != expected:
                    raise _refuse(path, name, f"is {piece.get_dtype()} {found[1]}, expected {expected[0]} {expected[1]}")
            tensors = {name: f.get_tensor(name).float() for name in names}
    except (SessionError, FileNotFoundError):
        raise
    except Exception as err:  # safetensors refuses a damaged or foreign file with its own error types
        raise SessionError(f"{path} is not a readable state file ({type(err).__name__}: {err}); pass a file "
                           "written by StateSession.save") from err
    _check_values(path, tensors)
    layers = [LayerState(*(tensors[n][i : i + 1] for n in NAMES)) for i in range(num_layers)]
    if with_token_ids:
        return layers, tensors.get("last_logits"), tokens, ids
    return layers, tensors.get("last_logits"), tokens


def _token_ids(path, f, tokens: int) -> torch.Tensor:
    """The token_ids tensor, checked for dtype and shape before its data is read."""
    piece = f.get_slice("token_ids")
    shape = tuple(piece.get_shape())
    if piece.get_dtype() != "I64" or len(shape) != 1 or shape[0] < tokens:
        raise _refuse(path, "token_ids", f"are {piece.get_dtype()} {shape}, expected I64 (n,) with n >= the "
                      f"{tokens} tokens of the state")
    return f.get_tensor("token_ids")


def _refuse(path, field: str, what: str) -> SessionError:
    return SessionError(f"{path}: {field} {what}; the file is damaged or was edited, save the state again")


def _count(path, metadata, field: str) -> int:
    value = metadata.get(field, "")
    if not (value.isascii() and value.isdigit() and len(value) <= 20):
        raise _refuse(path, field, f"= {value!r} is not a count")
    return int(value)


def _check_header(path, metadata: dict, fingerprint: str, num_layers: int, hidden: int):
    if metadata.get("format") != FORMAT:
        raise SessionError(f"{path} is not a saved RWKV state (format {metadata.get('format')!r}); pass a file "
                           "written by StateSession.save")
    if metadata.get("version") != VERSION:
        raise SessionError(f"{path}: version {metadata.get('version')!r} of the state layout, this code reads "
                           f"version {VERSION}; save the state again with this version")
    if metadata.get("fingerprint") != fingerprint:
        raise SessionError(f"{path} was saved from a different model (fingerprint "
                           f"{str(metadata.get('fingerprint', '?'))[:12]} != {fingerprint[:12]}); load it with "
                           "the same weights and dtype, or start a new session")
    dtype = DTYPES.get(metadata.get("dtype", ""))
    if dtype is None:
        raise _refuse(path, "dtype", f"= {metadata.get('dtype')!r} is none of {sorted(DTYPES)}")
    shape = (_count(path, metadata, "layers"), _count(path, metadata, "hidden"))
    if shape != (num_layers, hidden):
        raise _refuse(path, "layers/hidden", f"= {shape}, this model's state is {(num_layers, hidden)}")
    return _count(path, metadata, "tokens"), dtype


def _check_values(path, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        if not torch.isfinite(t).all():
            raise _refuse(path, name, "holds NaN or inf")
    if (tensors["bb"] < 0).any():
        raise _refuse(path, "bb", "holds a negative value, but the denominator is a sum of positive terms")
    if (tensors["pp"] < NO_EXPONENT).any():
        raise _refuse(path, "pp", f"holds a value below the empty marker {NO_EXPONENT}")
