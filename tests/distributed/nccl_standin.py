"""NCCL semantics on a CPU machine: groups that report `nccl`, a stand-in CUDA device, and collectives that refuse
what NCCL refuses.

The stand-in device is torch's lazy-tensor device (TorchScript backend, shipped with CPU torch): unlike `meta` it
holds data, so a collective can really run and the caller's result can be checked number by number. The strict
collectives raise NCCL's own error for a tensor on any other device ("No backend type associated with device
type cpu"), then run the real gloo collective on a host copy and write the result back into the device tensor,
as NCCL would leave it. The host group (`distributed.cpu_group()`, gloo, as `init_distributed` builds it under
NCCL) takes CPU tensors only, and pickled objects may travel on it alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import mcore_rl.distributed as D

TENSOR_OPS = ("all_reduce", "broadcast", "all_gather", "send", "recv")
OTHER_OPS = ("barrier", "broadcast_object_list")


_LAZY: list[torch.device] = []


def standin_device() -> torch.device:
    if not _LAZY:  # the backend registers once per process
        import torch._lazy.ts_backend

        torch._lazy.ts_backend.init()
        _LAZY.append(torch.device("lazy", 0))
    return _LAZY[0]


@dataclass
class Call:
    op: str
    device: str  # device type of the tensor(s) handed over ("" for tensor-less ops)
    host: bool  # on the gloo host group


@dataclass
class StrictCollectives:
    """Records every torch.distributed collective; raises like NCCL/gloo on a tensor on the wrong device."""

    device: torch.device
    host_group: object
    nccl: bool = True
    calls: list[Call] = field(default_factory=list)
    forbid_all: bool = False  # any collective at all is an error (a code path that must not communicate)

    def _is_host(self, group) -> bool:
        return self.nccl and group is not None and group is self.host_group

    def expected(self, group) -> str:
        return self.device.type if self.nccl and not self._is_host(group) else "cpu"

    def _check(self, op: str, tensors: list[torch.Tensor], group) -> None:
        if self.forbid_all:
            raise AssertionError(f"collective {op} on a path that must run none")
        want = self.expected(group)
        for t in tensors:
            if t.device.type != want:
                raise RuntimeError(f"No backend type associated with device type {t.device.type}")
        self.calls.append(Call(op, tensors[0].device.type if tensors else "", self._is_host(group)))

    def wrap(self, op: str, real):
        def strict(*args, **kw):
            group = kw.get("group")
            if op == "all_gather":
                out, t = args[0], args[1]
                self._check(op, [*out, t], group)
                if t.device.type == "cpu":
                    return real(*args, **kw)
                host_out = [torch.empty_like(p, device="cpu") for p in out]
                res = real(host_out, t.cpu(), *args[2:], **kw)
                for dst, src in zip(out, host_out):
                    dst.copy_(src)
                return res
            if op in TENSOR_OPS:
                t = args[0]
                self._check(op, [t], group)
                if t.device.type == "cpu":
                    return real(*args, **kw)
                host = t.cpu()
                res = real(host, *args[1:], **kw)
                t.copy_(host)
                return res
            if op == "broadcast_object_list" and self.nccl and not self._is_host(group):
                raise RuntimeError("objects travel on the gloo host group only (NCCL would need CUDA byte tensors)")
            self._check(op, [], group)
            return real(*args, **kw)

        return strict

    def ops(self) -> list[tuple[str, str, bool]]:
        return [(c.op, c.device, c.host) for c in self.calls]


def install(monkeypatch, host_group, nccl: bool = True) -> StrictCollectives:
    """Patch `mcore_rl.distributed` to see NCCL groups (or plain gloo with nccl=False) and torch.distributed's
    collectives to the strict recorders. `host_group`: a gloo group standing for `cpu_group()`."""
    dev = standin_device()
    rec = StrictCollectives(dev, host_group, nccl)
    if nccl:
        monkeypatch.setitem(D._STATE, "cpu_group", host_group)
        monkeypatch.setattr(D, "backend_of", lambda group=None: "gloo" if group is host_group else "nccl")
        monkeypatch.setattr(D, "cuda_device", lambda: dev)
    for op in (*TENSOR_OPS, *OTHER_OPS):
        monkeypatch.setattr(dist, op, rec.wrap(op, getattr(dist, op)))
    return rec
