"""A request as the engine core sees it (vLLM v1 semantics: prompt + outputs so far, computed count)."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import IntEnum


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    REJECTED = 3
    WAITING_FOR_REMOTE_KVS = 4      # holds blocks while a KV connector loads its prefix (sim/core/connector.py)
    ABORTED = 5          # the client gave up (a timeout): removed from the engine, its KV freed


@dataclass(eq=False, slots=True)
class Request:
    request_id: int
    arrival_time: float
    prompt_tokens: int
    max_output_tokens: int
    priority: int = 0
    arrival_order: int = 0              # submission order to the scheduler (breaks arrival-time ties)
    # Prefix ids, one per `prefix_block_tokens` prompt tokens (Mooncake hash_ids), or None.
    prefix_hash_ids: tuple[int, ...] | None = None
    prefix_block_tokens: int | None = None
    # multi-turn sessions (sim/engine/sessions.py): the session, and whether the prefix ids go on past
    # the prompt over the answer (the conversation's next turn repeats it: its blocks are shared too)
    session: int | None = None
    ids_cover_output: bool = False

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    swapped_tokens: int = 0             # tokens held in CPU swap space while preempted (swap mode)
    replica: int = 0
    first_scheduled_time: float | None = None
    # time each output token was produced; a float64 array('d'): 8 bytes a token, not a list's ~32
    token_times: array = field(default_factory=lambda: array("d"))
    finish_time: float | None = None
    reject_reason: str | None = None
    output_capped: bool = False         # max_output_tokens cut to fit max_model_len at admission
    # prefix caching (sim/core/kv_manager.py): blocks hashed so far, the hash chain of a request with
    # prefix ids (kept across preemptions), the private cache chain of one without
    num_cached_blocks: int = 0
    block_hashes: list[int] | None = None
    private_blocks: list | None = None
    # KV policies (sim/kv): token-rows evicted (per row), attention mass retained summed over steps
    kv_evicted_tokens: float = 0.0
    kv_mass_sum: float = 0.0
    kv_mass_steps: int = 0
    gpu_tokens: list[int] | None = None     # real backend: prompt ids then sampled ids (gpu/executor.py)
    # a plug-in policy's own per-request state: set and read by that policy only (None until it does)
    policy_state: object | None = None
    # KV connector (sim/core/connector.py): prompt tokens whose KV it supplied at admission, and what
    # a connector or the cluster layer attaches to the request (e.g. where a prefill leg left its KV)
    num_external_computed_tokens: int = 0
    kv_transfer_params: object | None = None
    # the cluster layer's record of where the request went (sim/cluster/route.py), or None
    route: object | None = None
    # speculative decoding (sim/core/spec_decode.py): draft tokens proposed for the next step (vLLM's
    # len(spec_token_ids)), and the drafts rejected in the last verification (their slots rewritten next)
    spec_tokens: int = 0
    spec_rejected: int = 0
    # this request's own conditional acceptance per draft position (its workload class's measured rates),
    # or None: the run's (SpecDecoder.accept)
    spec_conditional: tuple[float, ...] | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens known so far: the prompt plus every output token sampled."""
        return self.prompt_tokens + self.num_output_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1 or self.num_output_tokens == 0

    @property
    def remaining_output(self) -> int:
        return self.max_output_tokens - self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.REJECTED, RequestStatus.ABORTED)
