"""Paged SmolLM2 forward vs the dense reference, eviction masks, relocation, attention statistics."""
import pytest
import torch

from kvsim.gpu.attention import AttentionMetadata
from kvsim.gpu.cache import PagedKVCache
from kvsim.gpu.model import LlamaModel, ModelConfig
from kvsim.gpu.prompts import prompt_token_ids




class Allocator:
    """Test-only stand-in for the engine core: contiguous blocks per sequence (and per layer/head)."""

    def __init__(self, config: ModelConfig, layout: str, block_size: int, max_tokens: int, num_seqs: int):
        self.layout, self.bs = layout, block_size
        self.blocks_per_seq = -(-max_tokens // block_size)
        streams = 1 if layout == "shared" else config.layers * config.kv_heads
        self.num_blocks = num_seqs * streams * self.blocks_per_seq
        per_seq = torch.arange(streams * self.blocks_per_seq).view(streams, self.blocks_per_seq)
        # interleave sequences so block ids are not trivially ordered per sequence
        tables = [per_seq * num_seqs + s for s in range(num_seqs)]
        shape = (self.blocks_per_seq,) if layout == "shared" else (config.layers, config.kv_heads, self.blocks_per_seq)
        self.tables = torch.stack([t.reshape(shape) for t in tables])

    def cache(self, config: ModelConfig, **kw) -> PagedKVCache:
        return PagedKVCache.for_model(config, self.layout, self.num_blocks, self.bs, **kw)

    def slots(self, seq: int, positions: torch.Tensor) -> torch.Tensor:
        entry, off = positions // self.bs, positions % self.bs
        return self.tables[seq][..., entry].movedim(-1, 0) * self.bs + off.view(-1, *[1] * (self.tables.dim() - 2))

    def step(self, seqs: list[tuple[int, list[int], int]], score_window: int = 0):
        """seqs: (seq index, new token ids, tokens already computed) -> (input_ids, positions, meta)."""
        ids, pos, slots, starts, lens = [], [], [], [0], []
        for seq, tokens, done in seqs:
            p = torch.arange(done, done + len(tokens))
            ids += tokens
            pos.append(p)
            slots.append(self.slots(seq, p))
            starts.append(starts[-1] + len(tokens))
            lens.append(done + len(tokens))
        tables = self.tables[torch.tensor([s for s, _, _ in seqs])]
        meta = AttentionMetadata(torch.tensor(starts), torch.tensor(lens), torch.cat(slots), tables,
                                 score_window=score_window)
        return torch.tensor(ids), torch.cat(pos), meta


def run_greedy(model, layout, block_size, prompts, chunk, decode_steps):
    """Chunked prefill of all prompts in mixed steps, then batched greedy decodes; returns per-step logits."""
    alloc = Allocator(model.config, layout, block_size, max(map(len, prompts)) + decode_steps, len(prompts))
    cache = alloc.cache(model.config)
    done = [0] * len(prompts)
    seqs = [list(p) for p in prompts]
    history = [[] for _ in prompts]
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)) or any(len(s) < len(p) + decode_steps for s, p in zip(seqs, prompts, strict=True)):
        batch = []
        for i, (d, s) in enumerate(zip(done, seqs, strict=True)):
            if d < len(s):
                batch.append((i, s[d:d + chunk], d))
        ids, pos, meta = alloc.step(batch)
        logits = model.forward(ids, pos, meta, cache)
        for row, (i, tokens, d) in enumerate(batch):
            done[i] = d + len(tokens)
            if done[i] == len(seqs[i]):
                history[i].append(logits[row])
                if len(seqs[i]) < len(prompts[i]) + decode_steps:
                    seqs[i].append(int(logits[row].argmax()))
    return seqs, history


def assert_matches_dense(model, prompt, seq, history, atol):
    """One dense forward over the paged run's final sequence: logits agree at every generated
    position and every generated token is the dense greedy choice."""
    dense = model.dense_forward(torch.tensor(seq))
    positions = range(len(prompt) - 1, len(prompt) - 1 + len(history))
    for got, pos in zip(history, positions, strict=True):
        torch.testing.assert_close(got, dense[pos], atol=atol, rtol=1e-4)
    assert seq[len(prompt):] == dense[len(prompt) - 1:-1].argmax(-1).tolist()


@pytest.mark.parametrize("layout", ["shared", "per_head"])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_paged_matches_dense_mixed_batches(small, layout, block_size):
    prompts = [prompt_token_ids(21, seed=1), prompt_token_ids(12, seed=2)]
    seqs, history = run_greedy(small, layout, block_size, prompts, chunk=8, decode_steps=3)
    for prompt, seq, logits in zip(prompts, seqs, history, strict=True):
        assert len(seq) == len(prompt) + 3
        assert_matches_dense(small, prompt, seq, logits, atol=2e-4)


def test_full_smollm2_paged_greedy_matches_dense_and_answers(smollm2):
    from kvsim.gpu.tokenizer import Tokenizer
    tok = Tokenizer.smollm2()
    prompt = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    seqs, history = run_greedy(smollm2, "per_head", 16, [prompt], chunk=16, decode_steps=7)
    assert_matches_dense(smollm2, prompt, seqs[0], history[0], atol=5e-4)
    assert tok.decode(seqs[0][len(prompt):]).startswith("The capital of France is Paris")


@pytest.mark.parametrize("layout", ["shared", "per_head"])
def test_scores_match_dense_attention_probabilities(small, layout):
    prompt = prompt_token_ids(30, seed=3)
    alloc = Allocator(small.config, layout, 8, 31, 1)
    cache = alloc.cache(small.config)
    window = 5
    # two prefill chunks: the statistics come from the last chunk's last `window` queries
    small.forward(*alloc.step([(0, prompt[:12], 0)]), cache)
    ids, pos, meta = alloc.step([(0, prompt[12:], 12)], score_window=window)
    small.forward(ids, pos, meta, cache)
    _, probs = small.dense_forward(torch.tensor(prompt), return_probs=True)      # [L, heads, T, T]
    L, nh = probs.shape[:2]
    H = small.config.kv_heads
    grouped = probs[:, :, -window:, :].reshape(L, H, nh // H * window, -1)
    want_sum, want_sq = grouped.sum(2), (grouped ** 2).sum(2)                       # [L, H, T]
    got_sum, got_sq = meta.scores.sum[0], meta.scores.sq[0]                         # [L, H, M*bs] in table order
    # contiguous allocation: table order == token order
    torch.testing.assert_close(got_sum[..., :30], want_sum, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_sq[..., :30], want_sq, atol=1e-5, rtol=1e-4)
    assert got_sum[..., 30:].abs().max() == 0
    assert int(meta.scores.num_queries[0]) == window
    # a decode step: statistics of its single query
    ids, pos, meta = alloc.step([(0, [int(prompt[-1])], 30)], score_window=1)
    small.forward(ids, pos, meta, cache)
    _, probs = small.dense_forward(torch.tensor(prompt + [int(prompt[-1])]), return_probs=True)
    want = probs[:, :, -1, :].reshape(L, H, nh // H, -1).sum(2)
    torch.testing.assert_close(meta.scores.sum[0][..., :31], want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("layout", ["shared", "per_head"])
def test_evicted_slots_relocated_by_compaction_leave_logits_unchanged(small, layout):
    """Evict tokens, decode; compact the survivors to other slots (move), decode again: same logits,
    and the survivors' K/V are bit-identical after the move."""
    prompt = prompt_token_ids(40, seed=5)
    bs = 4
    alloc = Allocator(small.config, layout, bs, 48, 1)
    cache = alloc.cache(small.config)
    small.forward(*alloc.step([(0, prompt, 0)]), cache)
    evicted_positions = torch.tensor([3, 5, 6, 17, 18, 19, 25])
    cache.evict(alloc.slots(0, evicted_positions).reshape(-1))
    k_before, v_before = cache.k.clone(), cache.v.clone()
    probe = (0, [int(prompt[-1])], 40)
    ids, pos, meta = alloc.step([probe])
    logits_masked = small.forward(ids, pos, meta, cache)

    # undo the probe token, then compact: move tokens 36..39 into the holes left by 3, 5, 6, 17
    cache.evict(alloc.slots(0, torch.tensor([40])).reshape(-1))
    src = alloc.slots(0, torch.tensor([36, 37, 38, 39])).reshape(-1)
    dst = alloc.slots(0, evicted_positions[:4]).reshape(-1)
    cache.move_slots(src, dst)
    assert not cache.live.view(-1)[src].any() and cache.live.view(-1)[dst].all()
    flat = (lambda t: t.view(t.shape[0], -1, *t.shape[3:])) if layout == "shared" else (lambda t: t.view(-1, t.shape[-1]))
    for before, after in ((k_before, cache.k), (v_before, cache.v)):
        if layout == "shared":
            assert torch.equal(flat(after)[:, dst], flat(before)[:, src])
        else:
            assert torch.equal(flat(after)[dst], flat(before)[src])
    ids, pos, meta = alloc.step([probe])
    logits_moved = small.forward(ids, pos, meta, cache)
    torch.testing.assert_close(logits_moved, logits_masked, atol=1e-5, rtol=1e-5)
    # and evicting changes the output (the mask is really applied)
    full = alloc.cache(small.config)
    small.forward(*alloc.step([(0, prompt, 0)]), full)
    logits_full = small.forward(*alloc.step([probe]), full)
    assert (logits_full - logits_masked).abs().max() > 1e-3


def test_metadata_errors_name_the_field(small):
    alloc = Allocator(small.config, "shared", 16, 16, 1)
    cache = alloc.cache(small.config)
    ids, pos, meta = alloc.step([(0, [1, 2, 3], 0)])
    meta.slot_mapping = meta.slot_mapping[:2]
    with pytest.raises(ValueError, match="slot_mapping must be \\[3\\]"):
        small.forward(ids, pos, meta, cache)
    per_head = Allocator(small.config, "per_head", 16, 16, 1).cache(small.config)
    ids, pos, meta = alloc.step([(0, [1, 2, 3], 0)])
    with pytest.raises(ValueError, match="shared layout but the cache is per_head"):
        small.forward(ids, pos, meta, per_head)


def test_random_weights_are_seeded_and_shaped_from_a_spec():
    spec = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 128,
            "vocab": 100, "tied": False, "extra": "ignored"}
    a, b = LlamaModel.random(spec, seed=3), LlamaModel.random(spec, seed=3)
    ids = torch.tensor([1, 5, 7, 9])
    assert torch.equal(a.dense_forward(ids), b.dense_forward(ids))
    assert not torch.equal(a.dense_forward(ids), LlamaModel.random(spec, seed=4).dense_forward(ids))
    assert a.config.num_params == sum(t.numel() for t in a.w.values())
    # a 1-layer build (replay --weights random --layers 1 builds only what it runs) is the full model's
    # first layer with the same embedding and (untied) head
    one = LlamaModel.random({**spec, "layers": 1}, seed=3)
    assert one.w.keys() == a.truncated(1).w.keys()
    assert all(torch.equal(one.w[k], a.w[k]) for k in one.w)
    with pytest.raises(ValueError, match="missing field"):
        ModelConfig.from_spec({"layers": 2})
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        ModelConfig.from_spec({**spec, "kv_heads": 3})
