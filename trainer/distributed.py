"""Several training processes (torchrun): who am I, and the few collective operations the loop needs.

`torchrun --nproc_per_node N -m fastanchor train ...` starts N copies of the trainer with RANK,
LOCAL_RANK and WORLD_SIZE set; `start_processes` joins them into one process group (NCCL on
CUDA, one GPU per process; gloo on the CPU). Without torchrun everything here is a no-op for a
single process, so the loop reads the same either way; SLURM's `srun` starting several tasks
without torchrun is refused (each would train alone). When one process fails, torchrun ends the
others; a collective waits at most `timeout_seconds` (train.collective_timeout) for a process
that is gone. Under `torchrun --max-restarts` every attempt joins its process group under a key prefix of its
own (`group_store_prefix`). `injected_fault` is the tests' way to make one process fail (docs/distributed.md).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fastanchor.errors import ConfigError, FastAnchorError


@dataclass(frozen=True)
class Processes:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def several(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        """Only the main process (rank 0) writes files and shows progress."""
        return self.rank == 0


def _env_int(name: str, default: int, env=os.environ) -> int:
    value = env.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name} = {value!r}: expected an integer (set by torchrun)") from None


def start_processes(device: torch.device, timeout_seconds: int = 0) -> tuple[Processes, torch.device]:
    """Join the process group torchrun describes in the environment; return who we are and our device.

    On CUDA each process takes GPU LOCAL_RANK (whatever index train.device names); `timeout_seconds`
    (0: torch's default) bounds every collective's wait."""
    world_size = _env_int("WORLD_SIZE", 1)
    if world_size <= 1:
        refuse_srun_without_torchrun()
        return Processes(), device
    processes = Processes(rank=_env_int("RANK", 0), world_size=world_size, local_rank=_env_int("LOCAL_RANK", 0))
    if device.type == "cuda":
        if processes.local_rank >= torch.cuda.device_count():
            raise ConfigError(f"LOCAL_RANK = {processes.local_rank}, but this machine has {torch.cuda.device_count()} "
                              f"GPUs: expected at most one process per GPU (torchrun --nproc_per_node)")
        device = torch.device("cuda", processes.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = {"timeout": timedelta(seconds=timeout_seconds)} if timeout_seconds else {}
        prefix = group_store_prefix(os.environ)
        injected_late_start(processes)
        if prefix is None:
            dist.init_process_group(backend, rank=processes.rank, world_size=world_size, **timeout)
        else:
            store, _, _ = next(dist.rendezvous("env://", processes.rank, world_size, **timeout))
            dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=processes.rank,
                                    world_size=world_size, **timeout)
    return processes, device


def group_store_prefix(env) -> str | None:
    """The key prefix of this attempt's process group in torchrun's store, from torchrun's variables in `env`.

    torchrun's c10d rendezvous hands every attempt of the workers the same store (its agent's, TORCHELASTIC_USE_AGENT_STORE),
    which keeps the keys of the attempt before: a restarted process reading a peer's address before the peer has
    written its new one connects to a process that is gone (gloo: "connection refused", or a hang). On one node every
    process of an attempt has the same TORCHELASTIC_RESTART_COUNT, which names the attempt. Across nodes each agent
    counts its own restarts, so there the store must be a new one per attempt (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
    and a run that may restart without it is refused."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    if _env_int("GROUP_WORLD_SIZE", 1, env) > 1:
        if _env_int("TORCHELASTIC_MAX_RESTARTS", 0, env) > 0:
            raise ConfigError("torchrun --max-restarts over several nodes shares one store between attempts, whose stale "
                              "keys hang the restarted processes: start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                              "in its environment (docs/distributed.md)")
        return None
    return f"attempt{_env_int('TORCHELASTIC_RESTART_COUNT', 0, env)}/"


def refuse_srun_without_torchrun() -> None:
    """SLURM's srun started several tasks of this command without torchrun (no WORLD_SIZE): each would run alone."""
    tasks = _env_int("SLURM_STEP_NUM_TASKS", 1)
    if tasks > 1:
        raise ConfigError(f"srun started {tasks} tasks (SLURM_STEP_NUM_TASKS) without torchrun: each would run alone on "
                          f"all the data; start one task per node that runs torchrun: srun --ntasks-per-node=1 torchrun "
                          f"--nnodes=$SLURM_NNODES --nproc-per-node=GPUS --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 "
                          f"-m fastanchor ... (docs/distributed.md)")


FAULT = "FASTANCHOR_TEST_FAULT"  # tests only: "kill:RANK:STEP", "raise:RANK:STEP" or "kill-then-late:RANK:STEP"
LATE_START_SECONDS = 3.0


def injected_fault(processes: Processes, step: int) -> None:
    """Tests only: process RANK kills itself (SIGKILL) or raises a RuntimeError after global step STEP, as $FASTANCHOR_TEST_FAULT
    says, in torchrun's first attempt only (TORCHELASTIC_RESTART_COUNT 0 or unset), so a restarted run goes on."""
    fault = os.environ.get(FAULT)
    if not fault or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    kind, rank, at = fault.split(":")
    if processes.rank == int(rank) and step == int(at):
        if kind in ("kill", "kill-then-late"):
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected fault ({FAULT}) in process {rank} at step {step}")


def injected_late_start(processes: Processes) -> None:
    """Tests only: with $FASTANCHOR_TEST_FAULT "kill-then-late:RANK:STEP", process RANK of a restarted attempt joins
    the process group LATE_START_SECONDS after the others (as on a loaded machine), so that they read the store first."""
    fault = os.environ.get(FAULT, "")
    if fault.startswith("kill-then-late:") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        if processes.rank == int(fault.split(":")[1]):
            time.sleep(LATE_START_SECONDS)


def stop_processes(processes: Processes) -> None:
    if processes.several and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(processes: Processes, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce `tensor` in place over all processes (sum by default) and return it."""
    if processes.several:
        dist.all_reduce(tensor, op=op)
    return tensor


def broadcast_from_main(processes: Processes, value):
    """Rank 0's `value` on every process (any picklable object)."""
    if not processes.several:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_to_main(processes: Processes, value) -> list | None:
    """[value of rank 0, value of rank 1, ...] on rank 0, None elsewhere (tensors must be on the CPU)."""
    if not processes.several:
        return [value]
    gathered = [None] * processes.world_size if processes.main else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def gather_everywhere(processes: Processes, value) -> list:
    """[value of rank 0, value of rank 1, ...] on every rank (any picklable value; tensors on the CPU)."""
    if not processes.several:
        return [value]
    gathered = [None] * processes.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast_module_buffers(processes: Processes, module: torch.nn.Module) -> None:
    """Give every process rank 0's buffers (BatchNorm running statistics drift apart per rank)."""
    if processes.several:
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def on_main(processes: Processes, work):
    """`work()` on rank 0 only; its result (any picklable value) or its FastAnchorError reaches every rank,
    so no process is left waiting for the others."""
    if not processes.several:
        return work()
    outcome = None
    if processes.main:
        try:
            outcome = ("result", work())
        except FastAnchorError as error:
            outcome = ("error", error)
    kind, value = broadcast_from_main(processes, outcome)
    if kind == "error":
        raise value
    return value


def main_first(processes: Processes, work):
    """`work()` on rank 0, then on the other ranks (e.g. writing a dataset once, then finding it there);
    a FastAnchorError on rank 0 is raised on every rank. Each rank returns its own result."""
    if not processes.several:
        return work()
    results = []
    on_main(processes, lambda: results.append(work()))  # only success or failure travels
    return results[0] if processes.main else work()
