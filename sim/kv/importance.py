"""Where token importance (attention scores) comes from.

Three sources stand behind one interface, `ImportanceSource`:

- `SyntheticImportance` (simulator default): a parametric per-head attention model. Each row
  (layer, KV head) has a head type — `sink` (mass on the first tokens), `local` (mass on a recent
  window), `heavy` (a few heavy-hitter tokens anywhere), `spread` (near-uniform) — and per-head
  parameters; each request jitters the concentration, so the number of tokens holding 95% of the
  mass varies across heads and across requests. The attention a token at position t receives from
  the query at position q (q >= t) is

      a_q(t) = s * sink(t) + l * exp(-(q - t) / tau) / Z_l(q) + (1 - s - l) * w(t) / Z_w(q)

  with sink(t) a fixed distribution over the first `num_sink` tokens, Z_l, Z_w normalizers over
  ALL positions 0..q (evicted ones included: this is the full-cache attention), and content weights
  w(t) = exp(sigma * z), z ~ N(0, 1) drawn per (request, row, position) from a generator seeded
  by (config seed, request id, chunk of positions), so results are deterministic and independent
  of batch composition. Real content weights are positionally correlated (neighbouring tokens of a
  phrase are important or unimportant together, so H2O evicts runs of tokens and empties whole
  pages); the optional fields `content_correlation` rho and `correlation_length` ell mix in a
  smooth component:

      z(t) = sqrt(rho) * u(t) + sqrt(1 - rho) * z_token(t),   u(t) = phi u(t-1) + sqrt(1 - phi^2) e(t)

  u is a stationary AR(1) process along positions (corr(u(t), u(t+k)) = phi^k, phi = exp(-1/ell)),
  so z stays N(0, 1) at every position (sigma keeps its meaning) and corr(z(t), z(t+k)) =
  rho * exp(-k / ell). u over a chunk is the AR(1) filter, written as one matrix product, over the
  innovations e of that chunk and the previous one (each drawn from its own seeded generator; the
  filter starts at zero CHUNK positions early, a variance deficit below phi^(2 * CHUNK) = 3e-4 for
  ell <= 64), so a chunk's weights still depend only on (seed, request, chunk). Without these
  fields (rho = 0) the weights are bit for bit the uncorrelated model's. `kvsim calibrate
  --attention ... --decisions` fits rho and ell to a replay's recorded H2O evictions
  (sim/calibration/correlation_fit.py). The block-occupancy fast mode (sim/kv/fast/) scores
  H2O with this model's heads in closed form but ignores these two fields.
  The optional `age_profile` section gives the row of the `shared` layout (one score per token, the
  mean over every layer and head, as SpvLLM's H2O) its own parameters: sink_share s, local_share l,
  tau, sigma, and an age exponent alpha that makes the content term fall with the token's age:

      content_q(t) = w(t) (1 + q - t)^-alpha / Z_a(q),   Z_a(q) = sum over positions p <= q of w(p) (1 + q - p)^-alpha

  Averaged over heads, real attention falls with age as a power law (SmolLM2-135M: about age^-0.8
  from 4 to 1,000 tokens) with a log-spread of ~0.8 around it, so the lowest scores (what H2O
  evicts) sit in the oldest tokens and evictions empty whole pages; the per-head parameters averaged
  into one row instead give a flat profile past a few dozen tokens and a log-spread of ~2.6, which
  scatters evictions. `kvsim calibrate --age-profile` fits the section to the real backend's
  head-averaged attention (sim/calibration/age_profile.py). Rows of the `per_head` layout keep their
  head types. Fast mode's closed-form scoring has no power-law term: it refuses such a model for
  score-driven policies in the shared layout (token mode runs it).
  What a policy sees is a_q restricted to the live tokens and renormalized (real attention only
  covers resident tokens); the mass the live tokens hold under the full
  cache, sum over live t of a_q(t), is the *attention mass retained* quality proxy.
  The query heads of a GQA group share their KV head's pattern in this model. Parameters come from
  a YAML file under `sim/data/importance/` (see `smollm2-135m.yaml`; `fit` tools may write others).

- Recorded decisions: what the real backend evicted, replayed exactly (see RECORDED FORMAT below)
  by the `recorded` policy (`sim.kv.policies.recorded`, kv.params.path = a replay directory).

- External scores: the real backend's executor calls `manager.supply_scores(request, scores)`
  with real attention (already GQA-reduced with the policy's `gqa_reduce`, see
  `PolicyContext.gqa_reduce`) before the manager runs the policy for the step.

RECORDED FORMAT (Parquet, written by gpu/ replay, read by `sim.kv.policies.recorded.load_recorded_decisions`)
----------------------------------------------------------------------------------
`decisions.parquet`, one row per token-row decision:
    request_id int64, step int32 (the request's decode step after which it happened; -1 =
    right after prefill), layer int16, head int16 (KV head; -1 for every head in the shared
    layout), position int64 (token position), action string ("evict" | "high" | "low"),
    engine_step int64 (engine step of the replay in which it happened), reason string ("policy":
    the policy's trigger after the step's attention | "pressure": `reclaim` before the step ran),
    num_tokens int64 (tokens cached for the request when it happened), event int64 (ordinal of the
    decision — one `compress` or `reclaim` result of one request — in the replay: two pressure
    decisions of a request in one engine step stay apart). Positions are taken from the manager's
    token state when the decision is applied, so later moves (compaction) in the same step do not
    blur them.
    In the shared layout layer is -1 as well. A pressure decision's `step` is the decode steps the
    request had completed (as for a policy decision after that step).
`attention_stats.parquet`, one row per (layer, KV head) and measured request:
    request_id int64, layer int16, head int16, num_keys int64 (context length),
    keys_95 int64 (fewest keys holding 95% of the mass of the last queries), sink_share float64
    (mass on the first 4 tokens), recent_share float64 (mass on the last 64 tokens)
The stats are what `SyntheticImportance` parameters are fitted to. The replay measures them when a
request's prefill completes: attention of the last w prompt queries (w = the policy's obs_window when
it needs scores, else 32) averaged over those queries and the query heads of each GQA group.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from ..io.safe_io import InputError, load_yaml_file
from .policy import PolicyContext
from .state import TokenState

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "importance"
HEAD_TYPES = ("sink", "local", "heavy", "spread")
NUM_SINK = 4
CHUNK = 256          # positions per content-weight draw
MAX_LOG_WEIGHT = 80.0
MAX_CORRELATION_LENGTH = 64.0   # tokens; keeps the AR(1) start-up deficit below exp(-2 * CHUNK / 64) = 3e-4


class ImportanceError(ValueError):
    """Bad importance-model file or parameter; the message names the file and field."""


class ImportanceSource:
    """Supplies per-step attention for a request's TokenState. Called by the KV manager."""

    def on_write(self, req_id: int, state: TokenState, rows: np.ndarray, slots: np.ndarray,
                 positions: np.ndarray) -> None:
        """Tokens at `positions` were written into (rows, slots)."""

    def prefill_scores(self, req_id: int, state: TokenState, window: int) -> np.ndarray | None:
        """[window, rows, S]: attention of the last `window` prompt queries over live slots."""
        return None

    def decode_scores(self, req_id: int, state: TokenState) -> tuple[np.ndarray | None, float]:
        """([rows, S] attention of the newest query over live slots, mean full-cache mass retained)."""
        return None, 1.0

    def release(self, req_id: int) -> None:
        pass


@dataclass(frozen=True)
class HeadTypeParams:
    sink_share: tuple[float, float]      # uniform range of s
    local_share: tuple[float, float]     # uniform range of l
    tau: tuple[float, float]             # log-uniform range of the local decay (tokens)
    sigma: tuple[float, float]           # uniform range of the content concentration


@dataclass(frozen=True)
class AgeProfile:
    """The `shared` layout's head-averaged row (see the module doc)."""
    exponent: float                      # alpha: content attention falls as (1 + age)^-alpha
    sigma: float                         # content concentration (log-sd of w) of the head average
    sink_share: float
    local_share: float
    tau: float                           # local decay (tokens)


AGE_PROFILE_FIELDS = ("exponent", "sigma", "sink_share", "local_share", "tau")


@dataclass(frozen=True)
class ImportanceModelSpec:
    name: str
    mix: dict[str, float]                # head-type probabilities (sparse layers)
    types: dict[str, HeadTypeParams]
    dense_layers: int                    # first layers are `spread`
    request_sigma_jitter: float          # per-request multiplicative lognormal jitter of sigma
    sink_weights: tuple[float, ...]      # distribution over the first NUM_SINK tokens
    content_correlation: float = 0.0     # rho: share of the content log-weight variance that is smooth in position
    correlation_length: float = 0.0      # ell (tokens): the smooth part's correlation decays as exp(-k / ell)
    age_profile: AgeProfile | None = None   # the shared layout's row, with an age exponent (module doc)

    @classmethod
    def load(cls, name_or_path: str | Path = "smollm2-135m") -> "ImportanceModelSpec":
        path = Path(name_or_path)
        if not path.suffix:
            path = DATA_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            known = ", ".join(sorted(p.stem for p in DATA_DIR.glob("*.yaml")))
            raise ImportanceError(f"importance model {name_or_path!r} not found; shipped: {known}, or a YAML path")
        try:
            data = load_yaml_file(path, what="importance model YAML file")
        except InputError as exc:
            raise ImportanceError(str(exc)) from None
        except yaml.YAMLError as exc:
            raise ImportanceError(f"{path}: not valid YAML ({getattr(exc, 'problem', None) or 'parse error'})") from None
        if not isinstance(data, dict):
            raise ImportanceError(f"{path}: expected a mapping (head_mix, head_types, ...) as in "
                                  f"{DATA_DIR / 'smollm2-135m.yaml'}, got {type(data).__name__}")
        try:
            return cls._from_mapping(path, data)
        except ImportanceError:
            raise
        except KeyError as exc:
            raise ImportanceError(f"{path}: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError):
            raise ImportanceError(f"{path}: malformed fields; expected head_mix (type -> probability), "
                                  "head_types (type -> sink_share, local_share, tau, sigma: [low, high]) and "
                                  f"numbers elsewhere, as in {DATA_DIR / 'smollm2-135m.yaml'}") from None

    @classmethod
    def _from_mapping(cls, path: Path, data: dict) -> "ImportanceModelSpec":
        mix = {k: float(v) for k, v in data["head_mix"].items()}
        bad = sorted(set(mix) - set(HEAD_TYPES))
        if bad:
            raise ImportanceError(f"{path}: head_mix: unknown head type(s) {bad}; expected {HEAD_TYPES}")
        if abs(sum(mix.values()) - 1) > 1e-6:
            raise ImportanceError(f"{path}: head_mix: probabilities sum to {sum(mix.values())}, expected 1")
        types = {}
        for t in HEAD_TYPES:
            p = data["head_types"][t]
            types[t] = HeadTypeParams(*(tuple(float(x) for x in p[k]) for k in
                                        ("sink_share", "local_share", "tau", "sigma")))
            if types[t].sink_share[1] + types[t].local_share[1] >= 1:
                raise ImportanceError(f"{path}: head_types.{t}: sink_share + local_share must stay < 1")
        sink = tuple(float(x) for x in data.get("sink_weights", [0.7, 0.1, 0.1, 0.1]))
        if len(sink) != NUM_SINK:
            raise ImportanceError(f"{path}: sink_weights: expected {NUM_SINK} values")
        rho, ell = _correlation_fields(path, data)
        return cls(name=data.get("name", path.stem), mix=mix, types=types,
                   dense_layers=int(data.get("dense_layers", 0)),
                   request_sigma_jitter=float(data.get("request_sigma_jitter", 0.0)),
                   sink_weights=tuple(np.asarray(sink) / sum(sink)),
                   content_correlation=rho, correlation_length=ell,
                   age_profile=_age_profile(path, data["age_profile"]) if "age_profile" in data else None)


def _number(path: Path, data: dict, field: str) -> float:
    value = data[field]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise ImportanceError(f"{path}: {field}: expected a finite number, got {value!r}")
    return float(value)


def _correlation_fields(path: Path, data: dict) -> tuple[float, float]:
    """(content_correlation, correlation_length), both 0 when absent (uncorrelated content weights)."""
    if "content_correlation" not in data:
        if "correlation_length" in data:
            raise ImportanceError(f"{path}: correlation_length given without content_correlation")
        return 0.0, 0.0
    rho = _number(path, data, "content_correlation")
    if not 0.0 <= rho < 1.0:
        raise ImportanceError(f"{path}: content_correlation: expected a share in [0, 1), got {rho}")
    if rho == 0.0 and "correlation_length" not in data:
        return 0.0, 0.0
    if "correlation_length" not in data:
        raise ImportanceError(f"{path}: content_correlation {rho} needs correlation_length (tokens, "
                              f"0 < ell <= {MAX_CORRELATION_LENGTH:g})")
    ell = _number(path, data, "correlation_length")
    if not 0.0 < ell <= MAX_CORRELATION_LENGTH:
        raise ImportanceError(f"{path}: correlation_length: expected tokens in (0, {MAX_CORRELATION_LENGTH:g}], "
                              f"got {ell}")
    return rho, ell


def _age_profile(path: Path, data) -> AgeProfile:
    if not isinstance(data, dict):
        raise ImportanceError(f"{path}: age_profile: expected a mapping with {', '.join(AGE_PROFILE_FIELDS)}")
    unknown = sorted(set(data) - set(AGE_PROFILE_FIELDS))
    if unknown:
        raise ImportanceError(f"{path}: age_profile: unknown field(s) {unknown}; expected {AGE_PROFILE_FIELDS}")
    missing = [k for k in AGE_PROFILE_FIELDS if k not in data]
    if missing:
        raise ImportanceError(f"{path}: age_profile.{missing[0]}: missing (the section needs {AGE_PROFILE_FIELDS})")
    v = {k: _number(path, data, k) for k in AGE_PROFILE_FIELDS}
    limits = {"exponent": (0.0, 4.0), "sigma": (0.0, 8.0), "sink_share": (0.0, 1.0), "local_share": (0.0, 1.0),
              "tau": (1e-3, 1e6)}
    for k, (lo, hi) in limits.items():
        if not lo <= v[k] <= hi:
            raise ImportanceError(f"{path}: age_profile.{k}: expected a value in [{lo:g}, {hi:g}], got {v[k]}")
    if v["sink_share"] + v["local_share"] >= 1:
        raise ImportanceError(f"{path}: age_profile: sink_share + local_share must stay < 1")
    return AgeProfile(**v)


class SyntheticImportance(ImportanceSource):
    def __init__(self, ctx: PolicyContext, spec: ImportanceModelSpec | str = "smollm2-135m", seed: int = 0):
        self.ctx = ctx
        self.spec = spec if isinstance(spec, ImportanceModelSpec) else ImportanceModelSpec.load(spec)
        self.seed = seed
        self.head_type, self.s, self.l, self.tau, self.sigma = self._head_params()
        ap = self.spec.age_profile
        self.age_exponent = ap.exponent if ap is not None and ctx.layout == "shared" else 0.0
        self._req: dict[int, dict] = {}
        self._filter: np.ndarray | None = None

    # ----- model-level parameters (a property of the model's heads, same for every request) -----
    def _head_params(self):
        ctx, spec = self.ctx, self.spec
        n = ctx.num_layers * ctx.num_kv_heads
        rng = np.random.default_rng([self.seed, 0x5EED])
        names = list(spec.mix)
        types = rng.choice(len(names), size=n, p=[spec.mix[k] for k in names])
        types = np.array([HEAD_TYPES.index(names[t]) for t in types])
        layer = np.arange(n) // ctx.num_kv_heads
        types[layer < spec.dense_layers] = HEAD_TYPES.index("spread")
        u = rng.random((4, n))
        s, l, tau, sigma = (np.empty(n) for _ in range(4))
        for i, t in enumerate(HEAD_TYPES):
            m = types == i
            p = spec.types[t]
            s[m] = p.sink_share[0] + u[0, m] * (p.sink_share[1] - p.sink_share[0])
            l[m] = p.local_share[0] + u[1, m] * (p.local_share[1] - p.local_share[0])
            tau[m] = np.exp(np.log(p.tau[0]) + u[2, m] * (np.log(p.tau[1]) - np.log(p.tau[0])))
            sigma[m] = p.sigma[0] + u[3, m] * (p.sigma[1] - p.sigma[0])
        ap = spec.age_profile
        if ctx.layout == "shared" and ap is not None:  # one row: the fitted head average
            return types[:1], *(np.array([x], dtype=np.float64) for x in (ap.sink_share, ap.local_share, ap.tau,
                                                                           ap.sigma))
        if ctx.layout == "shared":                   # one row: the mean head
            return types[:1], s.mean(keepdims=True), l.mean(keepdims=True), \
                np.exp(np.log(tau).mean(keepdims=True)), sigma.mean(keepdims=True)
        return types, s, l, tau, sigma

    # ----- per-request state --------------------------------------------------------------------
    def _r(self, req_id: int) -> dict:
        r = self._req.get(req_id)
        if r is None:
            rng = np.random.default_rng([self.seed, 1, req_id])
            jitter = np.exp(self.spec.request_sigma_jitter * rng.standard_normal(len(self.sigma)))
            r = {"sigma": (self.sigma * jitter).astype(np.float32), "wsum": np.zeros(len(self.sigma)),
                 "chunk": -1, "w": None}
            self._req[req_id] = r
        return r

    def _weights(self, req_id: int, r: dict, positions: np.ndarray) -> np.ndarray:
        """Content weights w [rows, len(positions)] (positions ascending, the same for every row)."""
        out = np.empty((len(self.sigma), len(positions)), dtype=np.float32)
        chunks = positions // CHUNK
        for c in np.unique(chunks):
            if r["chunk"] != c:
                # the exponent is capped below float32's exp overflow (88.7): a heavily jittered sigma
                # (fitted models allow it) must give a huge weight, not inf (inf / inf = nan scores)
                r["w"], r["chunk"] = np.exp(np.minimum(r["sigma"][:, None] * self._content_z(req_id, int(c)),
                                                       MAX_LOG_WEIGHT)), int(c)
            m = chunks == c
            out[:, m] = r["w"][:, positions[m] % CHUNK]
        return out

    def _content_z(self, req_id: int, chunk: int) -> np.ndarray:
        """z [rows, CHUNK] of one chunk of positions: N(0, 1) per position, correlated along positions
        as rho * exp(-k / ell) when the model has content_correlation rho > 0."""
        rows = len(self.sigma)
        z = np.random.default_rng([self.seed, 2, req_id, chunk]).standard_normal((rows, CHUNK), dtype=np.float32)
        rho = self.spec.content_correlation
        if rho == 0.0:
            return z
        innovations = np.concatenate([np.random.default_rng([self.seed, 3, req_id, c + 1]).standard_normal(
            (rows, CHUNK)) for c in (chunk - 1, chunk)], axis=1)
        smooth = innovations @ self._ar1_filter()
        return (np.sqrt(rho) * smooth + np.sqrt(1 - rho) * z).astype(np.float32)

    def _ar1_filter(self) -> np.ndarray:
        """[2 * CHUNK, CHUNK]: the stationary AR(1) filter u(t) = sum_k sqrt(1 - phi^2) phi^k e(t - k)
        from the innovations of the previous and the current chunk to u over the current chunk."""
        if self._filter is None:
            phi = np.exp(-1.0 / self.spec.correlation_length)
            lag = CHUNK + np.arange(CHUNK)[None, :] - np.arange(2 * CHUNK)[:, None]
            self._filter = np.where(lag >= 0, np.sqrt(1 - phi * phi) * phi ** np.maximum(lag, 0), 0.0)
        return self._filter

    def on_write(self, req_id, state, rows, slots, positions) -> None:
        """Tokens are written to every row at once: `slots` [rows, n], positions [n] ascending."""
        r = self._r(req_id)
        w = self._weights(req_id, r, positions)
        imp = state.add_field("imp_w", np.float32, 0.0)
        imp[rows[:, None], slots] = w
        r["wsum"] += w.sum(axis=1, dtype=np.float64)
        if self.age_exponent:                  # Z_a needs every written weight, evicted ones included
            hist = r.get("hist")
            need = int(positions[-1]) + 1
            if hist is None or hist.shape[1] < need:
                grown = np.zeros((len(self.sigma), max(need, 2 * (0 if hist is None else hist.shape[1]))), np.float64)
                if hist is not None:
                    grown[:, :hist.shape[1]] = hist
                r["hist"] = hist = grown
            hist[:, positions] = w

    def _attention(self, r: dict, state: TokenState, q: int) -> np.ndarray:
        """Full-cache attention a_q(t) of the query at position q, at every slot (0 where not live or t > q)."""
        pos = state.pos
        valid = state.live & (pos <= q) & (pos >= 0)
        age = np.where(valid, q - pos, 0).astype(np.float32)
        decay = np.exp(-1.0 / self.tau)
        z_local = (1 - decay ** (q + 1)) / (1 - decay)
        n_sink = min(NUM_SINK, q + 1)
        sink_w = np.asarray(self.spec.sink_weights[:n_sink]) / sum(self.spec.sink_weights[:n_sink])
        sink = np.zeros_like(age)
        is_sink = valid & (pos < n_sink)
        if is_sink.any():
            sink[is_sink] = sink_w[pos[is_sink]]
        s = self.s[:, None].astype(np.float32)
        l = self.l[:, None].astype(np.float32)
        local = np.exp(-age / self.tau[:, None].astype(np.float32)) / z_local[:, None].astype(np.float32)
        if self.age_exponent:
            content = self._aged_content(r, state, age, q)
        else:
            content = state.field("imp_w") / r["wsum_q"][:, None].astype(np.float32)
        a = s * sink + l * local + (1 - s - l) * content
        return np.where(valid, a, 0.0).astype(np.float32)

    def _aged_content(self, r: dict, state: TokenState, age: np.ndarray, q: int) -> np.ndarray:
        """w(t) (1 + age)^-alpha / Z_a(q) at every slot (the age-profile row, see the module doc)."""
        alpha = self.age_exponent
        z = r["hist"][:, q::-1] @ (1.0 + np.arange(q + 1)) ** -alpha          # [rows]: ages 0..q
        return (state.field("imp_w") * (1.0 + age) ** np.float32(-alpha) / z[:, None]).astype(np.float32)

    def prefill_scores(self, req_id, state, window):
        r = self._r(req_id)
        T = state.num_tokens
        qs = range(max(0, T - window), T)
        out = []
        imp = state.field("imp_w")
        for q in qs:
            # Z_w(q): remove the content weight of positions after q (they are live, not yet seen).
            later = state.live & (state.pos > q)
            r["wsum_q"] = r["wsum"] - np.where(later, imp, 0).sum(axis=1, dtype=np.float64)
            a = self._attention(r, state, q)
            out.append(a / np.maximum(a.sum(axis=1, keepdims=True), 1e-30))
        return np.stack(out).astype(np.float32)

    def decode_scores(self, req_id, state):
        if state.num_tokens < 1:
            raise ValueError(f"request {req_id}: decode scores need at least one token (the query); the token "
                             f"state holds none")
        r = self._r(req_id)
        r["wsum_q"] = r["wsum"]
        a = self._attention(r, state, state.num_tokens - 1)
        kept = a.sum(axis=1, keepdims=True)
        return a / np.maximum(kept, 1e-30), float(kept.mean())

    def release(self, req_id: int) -> None:
        self._req.pop(req_id, None)


def keys_for_mass(attn: np.ndarray, mass: float = 0.95) -> np.ndarray:
    """Fewest keys holding `mass` of each row's attention: attn [rows, T] -> int [rows]."""
    srt = -np.sort(-attn, axis=1)
    cum = np.cumsum(srt, axis=1) / np.maximum(srt.sum(axis=1, keepdims=True), 1e-30)
    return (cum < mass).sum(axis=1) + 1


def attention_stats(ctx: PolicyContext, spec: ImportanceModelSpec | str = "smollm2-135m", *, num_tokens: int = 1000,
                    num_requests: int = 4, last_queries: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    """Per-head statistics of the synthetic model in the units used for measured attention of real models:
    keys for 95% of the last queries' mass, sink share (first 4 tokens), last-64 share."""
    model = SyntheticImportance(ctx, spec, seed)
    k95, sink, recent = [], [], []
    for req in range(num_requests):
        st = TokenState.dense(ctx.rows, num_tokens)
        model.on_write(req, st, np.arange(ctx.rows), np.broadcast_to(np.arange(num_tokens), (ctx.rows, num_tokens)),
                       np.arange(num_tokens))
        a = model.prefill_scores(req, st, last_queries).sum(axis=0)     # [rows, T] (slot == position)
        a /= a.sum(axis=1, keepdims=True)
        k95.append(keys_for_mass(a))
        sink.append(a[:, :NUM_SINK].sum(axis=1))
        recent.append(a[:, -64:].sum(axis=1))
        model.release(req)
    return {"keys_95": np.concatenate(k95), "sink_share": np.concatenate(sink),
            "recent_share": np.concatenate(recent),
            "layer": np.tile(ctx.row_layer, num_requests)}
