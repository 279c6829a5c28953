"""A DFlash drafter for Hugging Face transformers, shipped inside exported folders (trust_remote_code).

Self-contained on purpose (torch and transformers only): it is copied next to `config.json` and
`model.safetensors` by `dflash_lightning.export`. Block queries attend over [context K/V; block K/V]: the
caller passes only the context that the block may see; sliding layers mask what their window hides. The
verification rule (greedy, and speculative sampling of docs/method.md section 6b) lives here too;
dflash_lightning's own decoder imports it, so served and evaluated decoding share one implementation.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half


def check_sampling(temperature: float, top_p: float = 1.0, top_k: int = 0) -> None:
    """Refuse sampling settings outside their range, naming the setting."""
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1: off), got {top_p}")
    if top_k < 0 or int(top_k) != top_k:
        raise ValueError(f"top_k must be an integer >= 0 (0: off), got {top_k}")


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The target's sampling distribution `P` of logits `[n, V]` (fp32): temperature, then top-k, then top-p.

    transformers' own warpers, in the order `generate` applies them, so `P` is what the target alone samples from.
    """
    check_sampling(temperature, top_p, top_k)
    if temperature == 0:
        raise ValueError("temperature 0 is greedy decoding: it has no sampling distribution")
    scores = TemperatureLogitsWarper(temperature)(None, logits.float())
    if top_k:
        scores = TopKLogitsWarper(int(top_k))(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The target's next token after logits `[V]`: argmax at temperature 0, else a sample of `P`.  # [] long"""
    if temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(sampling_probs(logits[None], temperature, top_p, top_k)[0], 1, generator=generator)[0]


def accepted_length(draft: torch.Tensor, posterior: torch.Tensor) -> int:
    """Greedy acceptance: the longest prefix with `draft[k] == posterior[k-1]` (draft `[n]` of slots 1..n)."""
    return int(accepted_lengths(draft, posterior))


def accepted_lengths(draft: torch.Tensor, posterior: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance of rows at once (`accepted_length` of each): drafts `[..., n]`, posteriors `[..., >= n]`.
    A draft no token equals (-1) ends its row's acceptance there.  # [...] long"""
    n = draft.shape[-1]
    return (draft == posterior[..., :n]).long().cumprod(-1).sum(-1)


def verify_drafts(
    draft: torch.Tensor, logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
    generator: torch.Generator | None = None, draft_probs: torch.Tensor | None = None,
) -> tuple[int, torch.Tensor, float]:
    """One verification (docs/method.md sections 6, 6b and 10): accepted drafts a, the token emitted after them, and the
    expected accepted count `sum_k prod_{i<=k} r_i` given the drafts.

    `draft` `[n-1]` are the proposals of slots 1..n-1, `logits` `[n, V]` the target's after each of the n verified
    block tokens. Greedy (temperature 0) accepts while the draft is the target's argmax, and the expected count is a
    itself. Sampling accepts `d_k` with probability `r_k = min(1, P_k(d_k) / q_k(d_k))`; the first rejected slot emits
    a sample of the residual `max(0, P_k - q_k)` renormalised, and after all n-1 accepted the bonus token is a sample
    of the next `P`. `draft_probs` `[n-1, V]` is q (sampled drafts); None: point masses on the drafts (argmax
    proposals), where `r_k = P_k(d_k)` and the residual is `P_k` without `d_k`.
    """
    if temperature == 0:
        posterior = logits.argmax(-1)  # [n]
        a = accepted_length(draft, posterior)
        return a, posterior[a], float(a)
    probs = sampling_probs(logits, temperature, top_p, top_k)  # [n, V]
    ratio = probs[:-1].gather(-1, draft[:, None])[:, 0]  # [n-1]: P_k(d_k)
    if draft_probs is not None:
        ratio = (ratio / draft_probs.float().gather(-1, draft[:, None])[:, 0]).clamp(max=1.0)
    # u < r holds with probability r for u uniform in [0, 1); all n-1 coins are drawn so the stream per step is fixed.
    coins = torch.rand(ratio.shape, generator=generator, device=ratio.device) < ratio
    a, expected = torch.stack([coins.float().cumprod(0).sum(), ratio.cumprod(0).sum()]).tolist()  # one host sync
    a = int(a)
    p = probs[a]
    if a < draft.numel():  # d_{a+1} rejected: sample the residual (multinomial renormalises)
        if draft_probs is None:
            p = p.index_fill(0, draft[a: a + 1], 0.0)  # max(0, P - point mass): P without d
        else:
            residual = (p - draft_probs[a].float()).clamp(min=0.0)
            p = residual if bool(residual.sum() > 0) else p  # P == q: a rejection has probability 0
    return a, torch.multinomial(p, 1, generator=generator)[0], expected


class DFlashAttention(nn.Module):
    """Grouped-query attention of block tokens over the context vectors and the block itself."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        h, d, bias = config.hidden_size, self.head_dim, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        # docs/method.md 3b: a sliding layer is causal inside the block unless config.json sets is_causal.
        layer_types = getattr(config, "layer_types", None)
        sliding = bool(layer_types) and layer_types[layer_idx] == "sliding_attention"
        is_causal = getattr(config, "is_causal", None)
        self.is_causal = sliding if is_causal is None else bool(is_causal)
        self.sliding_window = config.sliding_window if sliding else None

    def forward(
        self, hidden_states: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        attention_mask: torch.Tensor | None = None, past_key_values=None,
    ) -> torch.Tensor:
        """Block `[b, q, H]` over context `[b, c, H]`; cos/sin `[b, c + q, D]` of their positions."""
        b, q_len, _ = hidden_states.shape
        d = self.head_dim
        q = self.q_norm(self.q_proj(hidden_states).view(b, q_len, -1, d)).transpose(1, 2)  # [b, heads, q, D]
        # The context takes this layer's k/v projections but neither input_layernorm nor the MLP.
        kv_in = torch.cat([context, hidden_states], dim=1)  # [b, c + q, H]
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_in.shape[1], -1, d)).transpose(1, 2)  # [b, kv_heads, c+q, D]
        v = self.v_proj(kv_in).view(b, kv_in.shape[1], -1, d).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + rotate_half(k) * sin
        if past_key_values is not None:  # earlier context K/V, kept by the caller's transformers cache
            k, v = past_key_values.update(k, v, self.layer_idx)
        if attention_mask is None and (self.is_causal or self.sliding_window is not None):
            attention_mask = self.block_mask(q_len, k.shape[2], q.device)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)  # full layers: bidirectional
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))

    def block_mask(self, q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
        """This layer's mask `[1, 1, q, k]` over keys of consecutive positions that end with the block's.

        The query at position p + i sees key j when (p + i) - j < W, and a block key only up to itself when causal.
        """
        query = torch.arange(k_len - q_len, k_len, device=device)[:, None]
        key = torch.arange(k_len, device=device)[None, :]
        visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
        if self.is_causal:
            visible &= key <= query
        if self.sliding_window is not None:
            visible &= (query - key < self.sliding_window) & (key - query < self.sliding_window)
        return visible[None, None]


class BlockConv(nn.Module):
    """DFlash2's convolution around one sublayer (docs/method.md section 10), over the tokens of ONE block `[b, q, H]`:
    `conv(x, d, b)[t, c] = sum_{tau <= t} (b[tau, c] + d[t, tau, G(c)]) * x[t - tau, c]`, G(c) = c // g."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        dflash = config.dflash_config
        h, self.k, self.g = config.hidden_size, int(dflash["conv_kernel_size"]), int(dflash["conv_group_size"])
        self.base_kernel = nn.Parameter(torch.zeros(2, self.k, h))  # [2 (in, out), k, H]
        self.kernel_projection = nn.Linear(h, 2 * self.k * (h // self.g), bias=False)

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        """`conv_out(sublayer(conv_in(x)))`, both kernels from one projection of x (after the input norm)."""
        d = self.kernel_projection(x).unflatten(-1, (2, self.k, -1))  # [b, q, 2, k, H/g]
        return self.taps(sublayer(self.taps(x, d[:, :, 0], self.base_kernel[0])), d[:, :, 1], self.base_kernel[1])

    def taps(self, x: torch.Tensor, d: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """One convolution of `x [b, q, H]` with dynamic taps `d [b, q, k, H/g]` and base taps `[k, H]`."""
        grouped = (x.shape[-1] // self.g, self.g)
        out = torch.zeros_like(x).unflatten(-1, grouped)
        for tau in range(self.k):
            shifted = F.pad(x, (0, 0, tau, 0))[:, : x.shape[1]].unflatten(-1, grouped)  # slot t reads t - tau
            out = out + (base[tau].to(x.dtype).unflatten(-1, grouped) + d[:, :, tau, :, None]) * shifted
        return out.flatten(-2)


class CandidateSelector(nn.Module):
    """DFlash2's re-ranking of each slot's unary top K: `score(c) = u[c] + sum_r P[prev, r] (W h)[r] S[c, r]`."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        dflash = config.dflash_config
        r, self.top_k = int(dflash["selector_rank"]), int(dflash["selector_top_k"])
        self.predecessor_codebook = nn.Parameter(torch.zeros(config.vocab_size, r))  # bare: no `.weight`
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, r))
        self.hidden_projection = nn.Linear(config.hidden_size, r, bias=False)

    @torch.no_grad()
    def draft(
        self, hidden: torch.Tensor, logits: torch.Tensor, first_prev: int, temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts of consecutive slots `hidden [n, H]`, `logits [n, V]`, slot by slot with prev the block's first
        token, then each pick: the argmax score (temperature 0; q None), or a sample of q = softmax(score / T) over
        the K candidates, with q `[n, V]` (0 off the candidates) for verification.  # [n], [n, V] | None"""
        unary, ids = logits.float().topk(self.top_k, dim=-1)  # [n, K]
        projected = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype)).float()  # [n, r]
        q = None if temperature == 0 else torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        prev, picks = first_prev, []
        for i in range(ids.shape[0]):
            query = self.predecessor_codebook[prev].float() * projected[i]  # [r]
            score = unary[i] + self.successor_codebook[ids[i]].float() @ query  # [K]
            if q is None:
                pick = score.argmax()
            else:
                q[i, ids[i]] = probs = torch.softmax(score / temperature, -1)
                pick = torch.multinomial(probs, 1, generator=generator)[0]
            prev = int(ids[i, pick])
            picks.append(prev)
        return torch.tensor(picks, dtype=torch.long, device=logits.device), q


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 layer whose attention also reads the context; DFlash2 wraps each sublayer in a BlockConv."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)
        self.attention_conv: BlockConv | None = None  # set by DFlash2DraftModel
        self.mlp_conv: BlockConv | None = None

    def forward(self, hidden_states: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None = None, past_key_values=None) -> torch.Tensor:
        x = hidden_states

        def attend(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn(h, context, cos, sin, attention_mask, past_key_values)

        x = x + _sublayer(self.attention_conv, self.input_layernorm(x), attend)
        return x + _sublayer(self.mlp_conv, self.post_attention_layernorm(x), self.mlp)


def _sublayer(conv: BlockConv | None, x: torch.Tensor, fn) -> torch.Tensor:
    return fn(x) if conv is None else conv(x, fn)


class DFlashDraftModel(PreTrainedModel):
    """DFlash block-diffusion drafter: fc + hidden_norm over target features, Qwen3-style layers, final norm.

    The input embedding and output head are the target's and are not part of this model.
    """

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None) or {}
        projector = dflash.get("projector_type", getattr(config, "projector_type", None))
        if projector is not None:  # a drafter whose logits a projector corrects, on another block layout
            raise ValueError(f"dflash_config.projector_type {projector!r}: this file builds plain DFlash drafters, "
                             "not this one (SGLang serves a Domino folder; dflash_lightning evaluates it)")
        self.target_layer_ids = list(dflash["target_layer_ids"])
        self.mask_token_id = int(dflash["mask_token_id"])
        self.block_size = int(config.block_size)
        h = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(
        self,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """Final-normed hidden states of a block.  # [b, q, H]

        Args:
            position_ids: Positions of the context tokens then of the block tokens, `[b, c + q]`.
            attention_mask: Optional mask `[b, 1, q, cached + c + q]` (bool or additive), for every layer; None: each
                layer's own (full layers see everything, sliding layers their window).
            noise_embedding: Target embeddings of the block `[x, MASK, ..., MASK]`, `[b, q, H]`.
            target_hidden: Concatenated target features of the context tokens, `[b, c, K*H]`.
            past_key_values: Optional transformers cache holding earlier context K/V (crop it after each block).
        """
        past_key_values = kwargs.pop("cache", past_key_values)
        x = noise_embedding.to(self.fc.weight.dtype)
        context = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))  # [b, c, H]
        cos, sin = self.rotary_emb(x, position_ids)  # [b, c + q, D]
        for layer in self.layers:
            x = layer(x, context, cos, sin, attention_mask, past_key_values)
        return self.norm(x)

    def propose(
        self, hidden: torch.Tensor, logits: torch.Tensor, first_prev: int, temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts of slots 1.. from their hidden states `[n, H]` and logits `[n, V]`, and their draft distributions
        (None: point masses). DFlash proposes the argmax, also when sampling (docs/method.md 6b).  # [n], None"""
        return logits.argmax(-1), None

    def target_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Context features from a target's `output_hidden_states`: outputs of the target layers.  # [b, n, K*H]"""
        return torch.cat([hidden_states[j + 1] for j in self.target_layer_ids], dim=-1)

    @torch.no_grad()
    def spec_generate(
        self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
        stop_token_ids: list[int] | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
        generator: torch.Generator | None = None,
    ) -> torch.LongTensor:
        """Speculative decoding of one prompt `[1, P]` with the target; returns `[1, P + new]`.

        Temperature 0: the target's own greedy decoding token for token. Temperature > 0 (with top-p, top-k):
        speculative sampling, distributed exactly as sampling from the target alone (`generator`: the random stream).
        """
        check_sampling(temperature, top_p, top_k)
        sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, generator=generator)
        self.eval()
        B, device, stop = self.block_size, input_ids.device, set(stop_token_ids or [])
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        params = inspect.signature(target.forward).parameters
        cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.24
        target_cache, draft_cache = DynamicCache(), DynamicCache()
        out = target(input_ids=input_ids, **{cache_arg: target_cache}, use_cache=True, output_hidden_states=True,
                     logits_to_keep=1)
        context = self.target_features(out.hidden_states)  # [1, P, K*H]
        tokens = [int(next_token(out.logits[0, -1], **sampling))]
        start = input_ids.shape[1]  # position of the newest token, whose features are not known yet
        done = max_new_tokens <= 1 or tokens[0] in stop
        while not done:
            block = torch.full((1, B), self.mask_token_id, dtype=torch.long, device=device)
            block[0, 0] = tokens[-1]
            positions = torch.arange(start - context.shape[1], start + B, device=device)[None]
            hidden = self(positions, noise_embedding=embed(block), target_hidden=context,
                          past_key_values=draft_cache, use_cache=True)
            _crop(draft_cache, start)  # keep the context K/V, drop the block's
            drafts, q = self.propose(hidden[0, 1:], head(hidden[0, 1:].to(head.weight.dtype)), int(block[0, 0]),
                                     temperature, generator)
            block[0, 1:] = drafts
            block = block[:, : min(B, max_new_tokens - len(tokens))]  # verify only tokens still wanted
            q = None if q is None else q[: block.shape[1] - 1]
            out = target(input_ids=block, **{cache_arg: target_cache}, use_cache=True, output_hidden_states=True)
            a, bonus, _ = verify_drafts(block[0, 1:], out.logits[0], **sampling, draft_probs=q)
            new = block[0, 1: a + 1].tolist() + [int(bonus)]
            tokens += new
            start += a + 1
            _crop(target_cache, start)
            context = self.target_features(out.hidden_states)[:, : a + 1]
            done = len(tokens) >= max_new_tokens or bool(stop & set(new))
        for i, t in enumerate(tokens):
            if t in stop:
                tokens = tokens[: i + 1]
                break
        new_ids = torch.tensor(tokens[:max_new_tokens], dtype=input_ids.dtype, device=device)
        return torch.cat([input_ids, new_ids[None]], dim=1)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 (docs/method.md section 10): the DFlash drafter plus a BlockConv around each sublayer of every layer
    and a CandidateSelector that picks each slot's draft among the unary top K."""

    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        for layer in self.layers:
            layer.attention_conv, layer.mlp_conv = BlockConv(config), BlockConv(config)
        self.candidate_selector = CandidateSelector(config)
        self.post_init()

    def propose(
        self, hidden: torch.Tensor, logits: torch.Tensor, first_prev: int, temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafts along the selector's choices, greedy or sampled from q (section 10), and q.  # [n], [n, V] | None"""
        return self.candidate_selector.draft(hidden, logits, first_prev, temperature, generator)


def _crop(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers cache (negative crop works in 4.x and 5.x)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


__all__ = [
    "DFlash2DraftModel", "DFlashDraftModel", "accepted_length", "accepted_lengths", "check_sampling", "next_token",
    "sampling_probs", "verify_drafts",
]
