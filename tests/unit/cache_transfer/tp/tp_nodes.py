"""Two tensor-parallel nodes in one process, for the fan-out / fan-in tests: each rank its own
transfer manager and transport, and its own slice of the kv heads (the engine's partition);
the prefill ranks hold slices of one random "model" KV, the decode ranks sentinel pools. What
the nodes' rank links carry (node_common/tp/) is done here by hand: rank 0 opens the other
decode ranks' fan-ins and hears their outcome, and the other prefill ranks' outcomes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from cache_transfer import KVLayout, KVTransferManager, make_transport, pack_layer
from cache_transfer.state import TransferState
from cache_transfer.tp.fan_in import FanIn
from cache_transfer.tp.fan_out import FanOutSender
from cache_transfer.tp.head_routes import RankHeads
from cache_transfer.tp.route_tickets import DecodeRank
from cache_transfer.tp.session_group import RemotePart, SessionGroup
from cache_transfer.tp.tp_receiver import TPReceiver
from engine.distributed import partition_model
from pdserve.security import ClusterAuth

SENTINEL = -7.0
NUM_BLOCKS = 24
NUM_TOKENS = 10  # 3 blocks of 4
SRC_IDS = [5, 2, 9]
DST_IDS = [7, 1, 12, 3]  # ceil((10 + 1) / 4)
TIMEOUT_S = 10.0


def make_layout(num_kv_heads: int) -> KVLayout:
    return KVLayout("tp-test", 3, num_kv_heads, 8, 4, "float32")


def rank_heads(num_kv_heads: int, world_size: int) -> list[RankHeads]:
    """The engine's kv-head partition (engine/distributed/tp_shard.py)."""
    arch = SimpleNamespace(num_heads=8, num_kv_heads=num_kv_heads, head_dim=8,
                           intermediate_size=64, vocab_size=64)  # fmt: skip
    shards = [partition_model(arch, r, world_size).shard for r in range(world_size)]
    return [RankHeads(s.rank, s.kv_head_start, s.kv_head_end) for s in shards]


def _slice(caches, heads: RankHeads):
    return [
        (k[:, :, heads.kv_head_start : heads.kv_head_end].contiguous(),
         v[:, :, heads.kv_head_start : heads.kv_head_end].contiguous())
        for k, v in caches
    ]  # fmt: skip


@dataclass
class Rank:
    heads: RankHeads
    manager: KVTransferManager
    caches: list[tuple[torch.Tensor, torch.Tensor]]
    fan_out: FanOutSender | None = None
    fan_in: FanIn | None = None


@dataclass
class TPPair:
    layout: KVLayout  # the model's
    full_src: list[tuple[torch.Tensor, torch.Tensor]]
    prefill: list[Rank]
    decode: list[Rank]
    receiver: TPReceiver | None = None
    remote_groups: dict[int, SessionGroup] = field(default_factory=dict)

    @classmethod
    async def start(
        cls, num_kv_heads: int, src_tp: int, dst_tp: int, backend: str = "local",
        auth: ClusterAuth | None = None,
    ) -> TPPair:  # fmt: skip
        layout = make_layout(num_kv_heads)
        gen = torch.Generator().manual_seed(src_tp * 10 + dst_tp)
        shape = (NUM_BLOCKS, *layout.block_shape)
        full = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
                for _ in range(layout.num_layers)]  # fmt: skip
        prefill = [
            Rank(h, KVTransferManager(make_transport(backend), _rank(layout, h), auth=auth),
                 _slice(full, h))
            for h in rank_heads(num_kv_heads, src_tp)
        ]  # fmt: skip
        decode = []
        for h in rank_heads(num_kv_heads, dst_tp):
            pool = [(torch.full((NUM_BLOCKS, 4, h.kv_head_end - h.kv_head_start, 8), SENTINEL),
                     torch.full((NUM_BLOCKS, 4, h.kv_head_end - h.kv_head_start, 8), SENTINEL))
                    for _ in range(layout.num_layers)]  # fmt: skip
            manager = KVTransferManager(make_transport(backend), _rank(layout, h), pool, auth=auth)
            decode.append(Rank(h, manager, pool))
        return cls(layout, full, prefill, decode)

    def decode_ranks(self) -> list[DecodeRank]:
        return [DecodeRank(r.heads, r.manager.address, "") for r in self.decode]

    def open_receiver(self, held: int = 0) -> TPReceiver:
        """Decode rank 0's whole hand-off, the other ranks' fan-ins opened (what the rank link
        does); `held`: the prompt's leading blocks the decode node holds (a suffix hand-off)."""
        rank0 = self.decode[0]
        receiver = TPReceiver(rank0.manager, self.layout, self.decode_ranks(), rank0.caches,
                              DST_IDS[held:], NUM_TOKENS, (TIMEOUT_S, None),
                              num_cached_blocks=held)  # fmt: skip
        ticket = receiver.ticket()
        for rank, dst in zip(self.decode[1:], self.decode_ranks()[1:], strict=True):
            rank.fan_in = FanIn(rank.manager, ticket, dst, rank.caches, self.layout,
                                (TIMEOUT_S, None))  # fmt: skip
            receiver.whole.add_remote(
                _remote(ticket.transfer_id, rank.heads.rank, rank.fan_in.group)
            )
        receiver.whole.seal()
        self.receiver = receiver
        return receiver

    def open_senders(self, ticket) -> list[Rank]:
        """Every prefill rank's fan-out on `ticket`; rank 0 hears the others; the ranks that
        send something."""
        src = [r.heads for r in self.prefill]
        sending = []
        for rank in self.prefill:
            rank.fan_out = FanOutSender.create(rank.manager, ticket, self.layout, rank.heads,
                                               src, TIMEOUT_S)  # fmt: skip
            if rank.fan_out.routes:
                sending.append(rank)
        head = self.prefill[0].fan_out
        for rank in sending[1:]:
            head.whole.add_remote(_remote(ticket.transfer_id, rank.heads.rank, rank.fan_out.group))
        head.whole.seal()
        return sending

    async def send_all(
        self, sending: list[Rank], first_token: int = 42, held: int = 0, drafts: Sequence[int] = ()
    ) -> None:
        """Each sending rank packs and sends every layer (past the `held` blocks); rank 0 then
        the first token (with `drafts`: speculative decoding's)."""
        for layer in range(self.layout.num_layers):
            for rank in sending:
                k, v = rank.caches[layer]
                n_heads = rank.heads.kv_head_end - rank.heads.kv_head_start
                packed = torch.empty(
                    _rank(self.layout, rank.heads).layer_bytes(len(SRC_IDS) - held),
                    dtype=torch.uint8,
                )  # fmt: skip
                assert n_heads == k.shape[2]
                pack_layer(k, v, SRC_IDS[held:], packed)
                await rank.fan_out.send_packed_layers([(layer, packed)])
        await self.prefill[0].fan_out.send_first_token(first_token, None, "", drafts)

    def landed_as_sent(self, held: int = 0) -> bool:
        """Every decode rank holds, at DST_IDS, its heads of the model's KV at SRC_IDS (past
        the `held` blocks: DST_IDS[held:] hold SRC_IDS[held:])."""
        for rank in self.decode:
            h = rank.heads
            for (k, v), (fk, fv) in zip(rank.caches, self.full_src, strict=True):
                for dst, src in zip(DST_IDS[held:], SRC_IDS[held:]):
                    if not torch.equal(k[dst], fk[src][:, h.kv_head_start : h.kv_head_end]):
                        return False
                    if not torch.equal(v[dst], fv[src][:, h.kv_head_start : h.kv_head_end]):
                        return False
        return True

    async def close(self) -> None:
        for rank in [*self.prefill, *self.decode]:
            await rank.manager.close()


def _rank(layout: KVLayout, heads: RankHeads) -> KVLayout:
    return layout.with_heads(heads.kv_head_end - heads.kv_head_start)


def _remote(transfer_id: str, rank: int, group: SessionGroup) -> RemotePart:
    part = RemotePart(transfer_id, rank, on_abort=group.abort)
    group.add_finish_callback(
        lambda g: part.resolve(g.state == TransferState.SUCCESS, g.error or "")
    )
    return part
