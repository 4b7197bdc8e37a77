"""prefix_affinity: approximate prefix-cache routing, as llm-d's (approximate) prefix-cache scorer and
SGLang's cache-aware router do it without reading the replicas: the router remembers to which replica
it sent each chain of leading prompt blocks (hashed per `router_options.prefix_block_tokens` tokens,
an LRU of `router_options.prefix_table_size` entries) and scores a replica by the fraction of the
prompt's leading blocks it was sent before. Ties (no match): the least loaded replica."""
from collections import OrderedDict

from .base import RouterBase, register_router


def leading_block_hashes(req, block_tokens: int) -> list[int]:
    """Chained hashes of the prompt's full leading blocks of `block_tokens` tokens that the trace's
    prefix ids cover (a request without ids has none)."""
    ids, span = req.prefix_hash_ids, req.prefix_block_tokens
    if ids is None or not span:
        return []
    out, h = [], None
    for b in range((req.prompt_tokens - 1) // block_tokens):
        end = (b + 1) * block_tokens
        covering = -(-end // span)
        if covering > len(ids):
            break
        h = hash((h, tuple(ids[(b * block_tokens) // span:covering]), (b * block_tokens) % span))
        out.append(h)
    return out


def prefix_scores(matched: list[int], num_blocks: int) -> list[float]:
    return [m / num_blocks if num_blocks else 0.0 for m in matched]


@register_router("prefix_affinity")
class PrefixAffinity(RouterBase):
    reads = "outstanding"

    def __init__(self, replicas, options=None):
        super().__init__(replicas, options)
        self.block_tokens = getattr(options, "prefix_block_tokens", 64) or 64
        self.table_size = getattr(options, "prefix_table_size", 100_000) or 100_000
        self._where: OrderedDict = OrderedDict()       # block-chain hash -> set of replica indices

    def matched_blocks(self, hashes: list[int]) -> list[int]:
        matched = [0] * len(self.replicas)
        alive = set(range(len(self.replicas)))
        for n, h in enumerate(hashes, 1):
            alive &= self._where.get(h, set())
            if not alive:
                break
            for i in alive:
                matched[i] = n
        return matched

    def remember(self, hashes: list[int], index: int) -> None:
        where = self._where
        for h in hashes:
            where.setdefault(h, set()).add(index)
            where.move_to_end(h)
        while len(where) > self.table_size:
            where.popitem(last=False)

    def route(self, req):
        hashes = leading_block_hashes(req, self.block_tokens)
        scores = prefix_scores(self.matched_blocks(hashes), len(hashes))
        outstanding = self.signals.outstanding()
        replica = self.pick_max([s - 1e-9 * n for s, n in zip(scores, outstanding, strict=True)])
        self.remember(hashes, self.replicas.index(replica))
        return replica
