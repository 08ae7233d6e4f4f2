"""flashoverlap's own NCCL communicators, made from torch ProcessGroups.

A communicator is created collectively from any ProcessGroup (its NCCL
unique id is broadcast through that group) and registered under a string
name; the torch custom ops receive that name, as vLLM's ops receive group
names.
"""

from __future__ import annotations

import logging
import socket
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import _core, _env

ProcessGroup = dist.ProcessGroup
_log = logging.getLogger("flashoverlap")

_by_name: dict[str, "Communicator"] = {}
MAX_PEER_WORLD = 8


def resolve_group(group: Optional[ProcessGroup]) -> ProcessGroup:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "group: torch.distributed is not initialized; call torch.distributed.init_process_group() "
            "(e.g. under torchrun) before using flashoverlap's collectives"
        )
    if group is None:
        return dist.group.WORLD
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup, a communicator name or None, got {type(group).__name__}")
    return group


def _default_name(group: ProcessGroup) -> str:
    return f"pg:{group.group_name}"


class Communicator:
    """An NCCL communicator over the ranks of a ProcessGroup, on this rank's current CUDA device.

    Creation is collective: every rank of ``group`` must create it, in the same order.
    ``max_ctas`` caps the CTAs NCCL uses per collective (default: FLASHOVERLAP_NCCL_MAX_CTAS,
    else the SMs reserved for communication, FLASHOVERLAP_RESERVED_SMS).
    ``nccl=False`` makes one without NCCL: the ops then run only on the copy-engine backend
    (every rank on one node), and their sequential schedules use ``group``'s own collectives.
    Its ranks may share a GPU, which NCCL refuses (tests run two ranks on one device this way).
    """

    def __init__(self, group: Optional[ProcessGroup] = None, *, name: Optional[str] = None,
                 max_ctas: Optional[int] = None, device: Optional[torch.device] = None, nccl: bool = True):
        _env.ce_all_reduce()  # a bad value is refused before anything is made
        _env.ce_sums_queue()
        pg = resolve_group(group)
        self.group = pg
        self.ranks: tuple[int, ...] = tuple(dist.get_process_group_ranks(pg))
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)
        self.name = name if name is not None else _default_name(pg)
        if self.name in _by_name:
            raise ValueError(f"name: a communicator named {self.name!r} already exists; use get_communicator()")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device)
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"device: expected a CUDA device with an index, got {device}")
        self.device = device
        if max_ctas is None:
            reserved = _env.reserved_sms()
            max_ctas = _env.nccl_max_ctas() or (_core.NCCL_RESERVED_SMS if reserved is None else reserved) or None
        self.max_ctas = max_ctas
        self._peer = False
        self.nccl = bool(nccl)
        # The sequential schedule runs the group's own NCCL AllReduce where it
        # has one (torch's communicator is not capped to the reserved SMs), and
        # the group's collectives, whatever its backend, where this one has no NCCL.
        self.torch_collectives = "nccl" in str(dist.get_backend(pg)).lower() or not self.nccl
        uid = (_core.new_unique_id() if self.rank == 0 else bytes(128)) if self.nccl else None
        box = [(uid, socket.gethostname())]
        hosts = [None] * self.world_size
        dist.all_gather_object(hosts, box[0][1], group=pg)
        dist.broadcast_object_list(box, src=self.ranks[0], group=pg)
        # The copy-engine backend maps peers' memory: every rank on one host.
        self.one_node = len(set(hosts)) == 1 and self.world_size <= MAX_PEER_WORLD
        if not self.nccl and not self.one_node:
            raise ValueError(f"nccl: a communicator without NCCL needs every rank on one node (at most "
                             f"{MAX_PEER_WORLD}), got {self.world_size} ranks on {len(set(hosts))} hosts")
        _core.create_communicator(self.name, self.world_size, self.rank, box[0][0], device.index, max_ctas)
        _by_name[self.name] = self
        _load_profiles(device, max_ctas)
        _agree_on_profiles(pg, self.world_size)
        _log.info("created communicator %r: rank %d of %s on %s, %s", self.name, self.rank, list(self.ranks),
                  device, f"NCCL maxCTAs {max_ctas}" if self.nccl else "no NCCL")

    def ensure_peer_buffers(self, slot_bytes: int) -> None:
        """Collective: makes the copy-engine staging slots hold at least ``slot_bytes`` (grown
        to a power of two of at least 16 MiB, so that few shapes regrow them). Every rank calls
        it with the same size (as the ops do: all ranks call an op with the same shape)."""
        if _core.peer_slot_bytes(self.name) >= slot_bytes:
            return
        if not self.one_node:
            raise ValueError(
                f"backend: 'copy_engine' needs every rank of communicator {self.name!r} on one node; "
                "use backend='nccl'"
            )
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(
                f"backend: the copy-engine buffers of communicator {self.name!r} must grow to {slot_bytes} bytes, "
                "which cannot happen during CUDA graph capture; run the op once with this shape before capturing"
            )
        size = max(16 << 20, 1 << (slot_bytes - 1).bit_length())
        handle = _core.peer_prepare(self.name, size)
        handles = [None] * self.world_size
        dist.all_gather_object(handles, handle, group=self.group)
        _core.peer_attach(self.name, handles)
        self._peer = True
        _log.info("communicator %r: copy-engine slots of %d bytes", self.name, size)

    def destroy(self) -> None:
        """Unregisters the communicator; NCCL resources are freed once pending work is done.

        Collective once the copy-engine backend has been used: the peers may still be writing
        into this rank's buffers until every rank has finished its work, so all ranks wait
        for each other before the buffers go."""
        if _by_name.get(self.name) is self:
            del _by_name[self.name]
            if self._peer:
                _core.synchronize_communicator(self.name)
                dist.barrier(group=self.group, device_ids=[self.device.index])
            _core.destroy_communicator(self.name)

    def __repr__(self) -> str:
        return (f"Communicator(name={self.name!r}, rank={self.rank}, world_size={self.world_size}, "
                f"device={self.device}, nccl={self.nccl})")


def _load_profiles(device: torch.device, max_ctas: Optional[int]) -> None:
    """The machine's measured profiles, for the planner, before this communicator's first op
    (once per process and GPU model; a bad file is reported and skipped, never raised)."""
    from . import profiles

    try:
        props = torch.cuda.get_device_properties(device)
        profiles.load_for_device(props.name, props.multi_processor_count, max_ctas=max_ctas)
    except Exception as e:  # a profile must never break an op
        _log.warning("flashoverlap profiles not loaded: %s", e)


def _agree_on_profiles(pg: ProcessGroup, world: int) -> None:
    """Ranks must plan with the same profiles: a rank whose cache holds another file than its
    peers' would size its groups differently, and the collectives of the group would not match.
    Where the ranks' profiles differ, every rank drops them all (the same decision everywhere,
    made from the same gathered digests)."""
    from . import profiles

    digests = [None] * world
    dist.all_gather_object(digests, profiles.fingerprint(), group=pg)
    if len(set(digests)) > 1:
        profiles.drop_all("the ranks of a communicator loaded different profiles (different cache dirs or "
                          "files?); every rank plans with the built-in constants instead")


GroupLike = Union[None, ProcessGroup, str, Communicator]


def get_communicator(group: GroupLike = None, *, communicator: Union[None, str, Communicator] = None) -> Communicator:
    """The communicator for ``group`` (created collectively on first use), or the one named.

    When both ``group`` and ``communicator`` are given, their ranks must agree.
    """
    if isinstance(group, (str, Communicator)):
        if communicator is not None:
            raise ValueError("group: pass a communicator either as `group` or as `communicator`, not both")
        communicator, group = group, None
    if isinstance(communicator, str):
        if communicator not in _by_name:
            raise ValueError(f"communicator: no communicator named {communicator!r} (registered: {sorted(_by_name)})")
        communicator = _by_name[communicator]
    if communicator is not None and not isinstance(communicator, Communicator):
        raise TypeError(f"communicator: expected a Communicator or its name, got {type(communicator).__name__}")
    if communicator is not None:
        if group is not None:
            ranks = tuple(dist.get_process_group_ranks(resolve_group(group)))
            if ranks != communicator.ranks:
                raise ValueError(
                    f"group: its ranks {list(ranks)} differ from those of communicator "
                    f"{communicator.name!r} {list(communicator.ranks)}"
                )
        return communicator
    pg = resolve_group(group)
    existing = _by_name.get(_default_name(pg))
    if existing is not None and existing.group is pg:
        return existing
    if existing is not None:
        ranks = tuple(dist.get_process_group_ranks(pg))
        if ranks != existing.ranks:
            raise ValueError(
                f"group: its ranks {list(ranks)} differ from those of the communicator registered under "
                f"{existing.name!r} {list(existing.ranks)}; destroy it first"
            )
        return existing
    return Communicator(pg)


def communicator_by_name(name: str) -> Communicator:
    if name not in _by_name:
        raise ValueError(f"group_name: no communicator named {name!r} (registered: {sorted(_by_name)})")
    return _by_name[name]


def destroy_communicators(names: Optional[Sequence[str]] = None) -> None:
    """Destroys the named communicators (default: all). Call before destroy_process_group()."""
    for name in list(names if names is not None else _by_name):
        if name in _by_name:
            _by_name[name].destroy()
