"""`FSDP2Strategy`, registered as `strategy: fsdp2`: Lightning's ModelParallelStrategy (FSDP2 and tensor
parallel over a device mesh) with data parallelism over every process by default, and checkpoints that
are written atomically and fail clearly. The model itself is laid out by astrai_pl/parallel.py in
`Objective.configure_model`."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch.distributed.constants import default_pg_timeout

from .atomic import partial_path, replace_path
from .checkpoint import AtomicCheckpointIO, CheckpointError
from .checkpoint.archive import (
    check_sharded_complete,
    describe_unreadable,
    interrupted_copy,
    read_checkpoint,
    recover_interrupted_replace,
    verify_archive,
)
from .checkpoint.sharded import (
    checksum_mismatch,
    describe_dcp_failure,
    file_checksums,
    load_into,
    read_checksums,
    read_dcp_metadata,
    verify_folder,
    write_checksums,
)

# The floating-point dtypes a config or a command line names: FSDP2 param/reduce dtypes, `generate --dtype`.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ParallelConfigError(ValueError):
    """A parallelism setting does not fit the model or the devices."""


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy (FSDP2 + tensor parallel over a device mesh) with defaults for
    data parallelism and atomic, clearly failing checkpoints. `strategy: fsdp2` in YAML.

    Args:
        data_parallel_size: Processes that shard the model between them; "auto" = world size / tensor_parallel_size.
        tensor_parallel_size: Processes that split each matmul (1 = FSDP2 only); must divide the process
            count, the attention heads, the key/value heads and the MLP width.
        param_dtype: Dtype the sharded float32 parameters are gathered in for compute ("bfloat16" for FSDP2
            mixed precision); None keeps them as stored (combine with precision: bf16-mixed for autocast).
        reduce_dtype: Dtype of the gradient reduce-scatter; None = param_dtype.
        reshard_after_forward: Free gathered parameters after each block's forward (less memory, one
            more all-gather in backward).
        save_distributed_checkpoint: True: each rank writes its shard into a checkpoint directory;
            False: rank 0 gathers and writes one file that loads anywhere.
        process_group_backend: "nccl", "gloo", …; None picks the device's default (gloo on CPU).
        timeout: How long a collective may wait for the other processes before failing.
    """

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int = 1,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ):
        for name, value in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
            if value is not None and value not in DTYPES:
                raise ParallelConfigError(
                    f"FSDP2Strategy.{name}={value!r}: use one of {', '.join(DTYPES)} or None"
                )
        if tensor_parallel_size < 1:
            raise ParallelConfigError(
                f"FSDP2Strategy.tensor_parallel_size={tensor_parallel_size}: must be >= 1"
            )
        super().__init__(
            data_parallel_size,
            tensor_parallel_size,
            save_distributed_checkpoint,
            process_group_backend,
            timeout,
        )
        self.fsdp_options = {
            "param_dtype": param_dtype,
            "reduce_dtype": reduce_dtype,
            "reshard_after_forward": reshard_after_forward,
        }

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """AtomicCheckpointIO unless `trainer.plugins` names another (used for full-file checkpoints)."""
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    def setup_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        if self._data_parallel_size == "auto":
            if world % self._tensor_parallel_size:
                raise ParallelConfigError(
                    f"FSDP2Strategy.tensor_parallel_size={self._tensor_parallel_size} does "
                    f"not divide the {world} processes; use a divisor of the device count"
                )
            self._data_parallel_size = world // self._tensor_parallel_size
        super().setup_environment()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        """Sharded: every rank writes into the hidden folder `.NAME.partial`; the size and CRC-32 of each of
        its files go into its checksums.json, written last; then rank 0 moves it to `filepath` with
        replace_path, so a kill at any point leaves a complete checkpoint (what a cut-off replace left is put
        back first). Full: one atomic file written by rank 0, moved over a sharded folder the same way."""
        target = Path(self.broadcast(str(filepath)))
        partial = partial_path(target)
        if self.global_rank == 0:
            recover_interrupted_replace(target)
            if partial.is_dir():
                shutil.rmtree(partial)
        self.barrier()
        if not self._save_distributed_checkpoint and not target.is_dir():
            return super().save_checkpoint(checkpoint, target, storage_options)
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier()
        if self._save_distributed_checkpoint:
            self._write_checksums(partial)
        if self.global_rank == 0:
            replace_path(partial, target)
        self.barrier()

    def _gather(self, obj: Any) -> list[Any]:
        if not torch.distributed.is_initialized():
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, obj)
        return gathered

    def _write_checksums(self, folder: Path) -> None:
        """Each rank checksums its share of the folder's files; rank 0 writes the table."""
        names = self.broadcast(sorted(p.name for p in folder.iterdir() if p.is_file()))
        shares = self._gather(file_checksums(folder, names[self.global_rank :: self.world_size]))
        if self.global_rank == 0:
            write_checksums(folder, {name: sums for share in shares for name, sums in share.items()})

    def _verify_checksums(self, folder: Path) -> dict[str, list[int]] | None:
        """Each rank verifies its share of the folder's checksum table; every rank raises the first mismatch."""
        expected = read_checksums(folder)
        mine = sorted(expected or {})[self.global_rank :: self.world_size]
        problems = self._gather(checksum_mismatch(folder, expected, mine) if expected else None)
        problem = next((p for p in problems if p), None)
        if problem:
            raise CheckpointError(f"{problem}. Fix: resume from another checkpoint.")
        return expected

    def _load_sharded(self, path: Path) -> dict[str, Any]:
        """Lightning's sharded load, with every read through checkpoint/sharded.py: checksums first, metadata
        that runs no code, non-tensor entries weights-only, and CheckpointError naming the folder.

        With the LightningModule's `strict_loading` False (a LoRA run, whose checkpoints hold the adapter but
        not the frozen base) only the weights the folder holds are read, and a trained weight it lacks is refused
        (only frozen ones may be absent). The weights read are returned as the checkpoint's `state_dict`, so
        `on_load_checkpoint` sees what the folder held."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        check_sharded_complete(path)
        expected = self._verify_checksums(path)
        metadata = read_dcp_metadata(path)
        verify_folder(path, metadata, expected)
        module, strict = self.model, self.lightning_module.strict_loading
        try:
            weights = get_model_state_dict(module)
            if not strict:
                weights = {k: v for k, v in weights.items() if f"state_dict.{k}" in metadata.state_dict_metadata}
                _check_trained_weights_held(path, module, weights)
            load_into({"state_dict": weights}, path, metadata)
            module.load_state_dict(weights, strict=strict)
            for i, optimizer in enumerate(self.optimizers):
                state = {f"optimizer_{i}": get_optimizer_state_dict(module, optimizer)}
                load_into(state, path, metadata)
                set_optimizer_state_dict(module, optimizer, optim_state_dict=state[f"optimizer_{i}"],
                                         options=StateDictOptions(cpu_offload=True))
        except (RuntimeError, ValueError, KeyError) as err:
            if isinstance(err, CheckpointError):
                raise
            raise CheckpointError(describe_dcp_failure(path, err)) from err
        return {**read_checkpoint(path / "meta.pt"), "state_dict": weights}

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded folder through `_load_sharded`; a full file verified first. A path that a cut-off replace
        left missing is read from the complete copy beside it. Either way the checkpoint returned keeps its
        `state_dict` (the weights are already in the model), so `on_load_checkpoint` sees which it held."""
        path = Path(self.broadcast(str(checkpoint_path)))
        path = interrupted_copy(path) or path
        if path.is_dir():
            return self._load_sharded(path)
        if path.is_file():
            verify_archive(path)
        try:
            checkpoint = super().load_checkpoint(path, weights_only=True)
        except (RuntimeError, ValueError, OSError, EOFError) as err:
            if isinstance(err, CheckpointError) or not _looks_unreadable(err):
                raise
            raise CheckpointError(describe_unreadable(path, err)) from err
        if "state_dict" not in checkpoint:  # Lightning pops it while loading; memory-mapped, nothing is copied
            checkpoint["state_dict"] = torch.load(path, mmap=True, map_location="cpu", weights_only=True)["state_dict"]
        return checkpoint


def _check_trained_weights_held(path: Path, module: torch.nn.Module, held: dict[str, Any]) -> None:
    """CheckpointError when a checkpoint read non-strictly lacks a weight that `module` trains: only frozen weights
    (a LoRA run's base, read again from init_from) may be absent."""
    missing = sorted(n for n, p in module.named_parameters() if p.requires_grad and n not in held)
    if missing:
        raise CheckpointError(
            f"{path}: lacks {len(missing)} trained weight(s) (e.g. {missing[0]}); only frozen weights may be absent "
            "from it. Fix: resume with the settings it was trained with (model.init_args.lora: the same adapter "
            "and modules_to_save), or start a new run from it with init_from")


def _looks_unreadable(err: BaseException) -> bool:
    """A read error (torch.load / distributed checkpoint), as opposed to a shape or key mismatch."""
    text = f"{type(err).__name__}: {err}"
    return not any(word in text for word in ("size mismatch", "Missing key", "Unexpected key"))


def register_strategies() -> None:
    if "fsdp2" not in StrategyRegistry:
        StrategyRegistry.register(
            "fsdp2",
            FSDP2Strategy,
            description="FSDP2 per block + root; tensor parallel when tensor_parallel_size > 1",
        )


register_strategies()
