"""A rank's place among several (uses MLX): its group and its device, settled
before it loads anything else.

On CUDA, `import mlx.core` loads libnccl, or takes the one the process has
loaded already. PyTorch brings its own (from its pip package) and transformers
may import PyTorch, so a rank that loaded its tokenizer first ran another NCCL
build than one that did not, and NCCL refused to connect them ("invalid
usage"). Every rank therefore imports MLX and joins its group here, first,
before the tokenizer, mlx-lm or the model.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import sys

import mlx.core as mx

from smg_mlx.engine.ranks import lockstep
from smg_mlx.logs import format_bytes

log = logging.getLogger(__name__)


def join(rank: int) -> None:
    """Pick this rank's device, log where it runs, and join the launcher's group
    (a no-op when it launched one rank). Raises when the group cannot form or two
    ranks would share a GPU."""
    if sys.modules.get("torch") is not None:
        log.warning(
            "PyTorch was imported before MLX (by a sitecustomize or .pth file?): on CUDA this "
            "rank then uses PyTorch's libnccl, which may differ from the other ranks' (NCCL "
            "then fails with 'invalid usage')"
        )
    device = _own_device(rank)
    # Logged before the group forms: a failing NCCL ends the process at once,
    # and each rank's line then shows which library it loaded.
    log.info("rank %d runs on %s%s", rank, _describe(device), _nccl())
    group = lockstep.group()
    if group is None:
        return
    gpu = mx.device_info(device).get("uuid")  # CUDA's; Metal names none
    if gpu:
        _check_own_gpu(group, device, str(gpu))
    log.info("rank %d of %d joined the group", group.rank(), group.size())


def _own_device(rank: int) -> mx.Device:
    """This rank's device. Where it sees several GPUs (a launcher left
    CUDA_VISIBLE_DEVICES unset), the one mlx's NCCL backend binds it to: its rank
    modulo their count. mlx.launch gives each rank one GPU."""
    device = mx.default_device()
    count = mx.device_count(mx.gpu) if device.type == mx.gpu else 1
    if count > 1:
        device = mx.Device(mx.gpu, rank % count)
        mx.set_default_device(device)
    return device


def _describe(device: mx.Device) -> str:
    """The device and its facts: `Device(gpu, 0) (NVIDIA H200, 139.80 GiB, ...)`."""
    info = mx.device_info(device)
    memory = info.get("total_memory") or info.get("memory_size")
    facts = [info.get("device_name"), memory and format_bytes(int(memory))]
    if device.type == mx.gpu:
        facts.append(f"{mx.device_count(mx.gpu)} GPU(s) visible")
        if "CUDA_VISIBLE_DEVICES" in os.environ:
            facts.append(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}")
        facts.append(info.get("uuid"))
    return f"{device} ({', '.join(str(f) for f in facts if f)})"


def _nccl() -> str:
    """`; NCCL 2.28.3 from PATH` for each libnccl this process has loaded; "" for none."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libnccl.so" in line})
    except OSError:  # not Linux: no NCCL either
        return ""
    found = ""
    for path in paths:
        code = ctypes.c_int()
        ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code))
        major, rest = divmod(code.value, 10000)
        found += f"; NCCL {major}.{rest // 100}.{rest % 100} from {path}"
    return found


def _check_own_gpu(group: mx.distributed.Group, device: mx.Device, gpu: str) -> None:
    """Refuse, on every rank, two ranks on one GPU: each would budget the whole
    GPU's memory for itself."""
    channel = lockstep.Channel(group, mx.default_stream(device))
    refusal = shared_gpu(channel.gather((socket.gethostname(), gpu)))
    if refusal is not None:
        raise RuntimeError(refusal)


def shared_gpu(places: list[tuple[str, str]]) -> str | None:
    """Why the ranks cannot run where they are, each rank's (host, GPU) in rank
    order; None when each has a GPU of its own. A hostfile that lists a host
    twice gives both ranks CUDA_VISIBLE_DEVICES=0, for one."""
    shared = sorted({place for place in places if places.count(place) > 1})
    if not shared:
        return None
    host, gpu = shared[0]
    ranks = ", ".join(str(r) for r, place in enumerate(places) if place == shared[0])
    return (
        f"ranks {ranks} all run on GPU {gpu} of {host}: give each rank its own GPU "
        "(mlx.launch -n N on one host sets CUDA_VISIBLE_DEVICES per rank)"
    )
